"""Activation checkpointing of each transformer block: ``"full"`` or ``"selective"`` (op-level).

``full`` recomputes the whole block in backward; ``selective`` keeps matmul and attention outputs
and recomputes only the cheap elementwise / norm ops. The block's forward is wrapped in place, so
module and parameter names (and checkpoints) stay unchanged.

Example::

    >>> from meshkit.models import LlamaConfig, Transformer
    >>> from meshkit.plugins.activation_checkpoint import apply_ac
    >>> from meshkit.plugins.fsdp import find_blocks
    >>> model = Transformer(LlamaConfig.tiny())
    >>> apply_ac(find_blocks(model), "selective")
"""

from __future__ import annotations

import functools
from typing import Any, Literal

import torch
from torch import nn

__all__ = ["apply_ac", "check_ac_mode", "ACMode", "AC_MODES"]

ACMode = Literal["none", "full", "selective"]
AC_MODES: tuple[str, ...] = ("none", "full", "selective")


def check_ac_mode(mode: str) -> None:
    """Raise unless ``mode`` is one of :data:`AC_MODES`."""
    if mode not in AC_MODES:
        raise ValueError(
            f"NDParallelStrategy: `activation_checkpointing={mode!r}` must be 'none', 'full' or 'selective'."
        )


def apply_ac(blocks: list[tuple[str, nn.Module]], mode: ACMode) -> None:
    """Activation checkpointing of each block (in place, names unchanged): ``full`` or ``selective`` (op-level)."""
    check_ac_mode(mode)
    if mode == "none":
        return
    for _, block in blocks:
        block.forward = functools.partial(_checkpointed_forward, block.forward, mode)  # type: ignore[method-assign]


def _selective_policy() -> Any:
    from torch.utils.checkpoint import CheckpointPolicy

    save = {
        torch.ops.aten.mm.default,
        torch.ops.aten.addmm.default,
        torch.ops.aten.bmm.default,
        torch.ops.aten._scaled_dot_product_flash_attention.default,
        torch.ops.aten._scaled_dot_product_efficient_attention.default,
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    }

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        # Keep matmul and attention outputs; recompute the cheap elementwise / norm ops.
        return CheckpointPolicy.MUST_SAVE if op in save else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


CACHE_KWARGS = ("cache", "past_key_values", "past_key_value", "layer_past")
"""The key/value-cache arguments transformers' layers take; a checkpointed block runs without them."""


def _checkpointed_forward(original: Any, mode: str, *args: Any, **kwargs: Any) -> Any:
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    # A transformers model builds a key/value cache when `use_cache` is on (its config's default, training
    # included): the recomputation would append the block's keys again (twice the sequence: a selective
    # recompute fails on it, a full one attends over the copy). transformers' own gradient checkpointing drops
    # the cache the same way; a training step never reads it.
    for key in CACHE_KWARGS:
        if kwargs.get(key) is not None:
            kwargs[key] = None
    if kwargs.get("use_cache"):
        kwargs["use_cache"] = False

    extra: dict[str, Any] = {}
    if mode == "selective":
        extra["context_fn"] = functools.partial(create_selective_checkpoint_contexts, _selective_policy())
    return checkpoint(original, *args, use_reentrant=False, **extra, **kwargs)
