"""Checkpoints for every layout: DCP save / load with FQN-keyed optimizer states, and consolidation.

The strategy saves through DCP (one shard file per rank plus ``meta.pt``); DCP reshards on load,
so a checkpoint saved at one layout resumes at another. Optimizer states are flattened and keyed
by parameter FQN (:func:`flat_optimizer_state`), so ranks holding different pipeline stages save
disjoint keys and a checkpoint saved at one pp size loads at another (torchtitan does the same).
:func:`load_checkpoint` and :func:`optimizer_state` are the strategy's overrides, as plain functions.
For export, ``consolidate_checkpoint`` (or ``meshkit consolidate CKPT_DIR OUT.pt``) writes the
model's full tensors, keyed by parameter name, to a file ``torch.load(..., weights_only=True)``
reads. It needs no process group.

Example::

    >>> from meshkit.plugins.checkpointing import consolidate_checkpoint
    >>> consolidate_checkpoint("ckpts/last.ckpt", "model.pt", strip_prefix="model.")  # doctest: +SKIP
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch import nn

__all__ = [
    "flat_optimizer_state",
    "load_sharded_checkpoint",
    "load_checkpoint",
    "optimizer_state",
    "consolidate_checkpoint",
    "configure_parser",
    "run_cli",
]


def flat_optimizer_state(model: nn.Module, optimizer: Any) -> dict[str, Any]:
    """DCP optimizer state with ``flatten_optimizer_state_dict=True``: every entry, param-group settings
    included, keyed by the parameter's FQN, so ranks holding different stages save disjoint keys and
    a checkpoint saved at one pp size loads at another (torchtitan does the same)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    opts = StateDictOptions(cpu_offload=True, flatten_optimizer_state_dict=True)
    return get_optimizer_state_dict(model, getattr(optimizer, "_optimizer", optimizer), options=opts)


def load_sharded_checkpoint(strategy: Any, path: Any, weights_only: bool) -> dict[str, Any]:
    """Lightning's sharded-checkpoint load with flattened optimizer states (see :func:`flat_optimizer_state`)."""
    from lightning.fabric.strategies.model_parallel import _METADATA_FILENAME, _distributed_checkpoint_load
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_optimizer_state_dict,
    )

    path = Path(strategy.broadcast(path))
    module = strategy.model
    model_state = {"state_dict": get_model_state_dict(module)}
    _distributed_checkpoint_load(model_state, path)
    module.load_state_dict(model_state["state_dict"], strict=strategy.lightning_module.strict_loading)
    opts = StateDictOptions(cpu_offload=True, flatten_optimizer_state_dict=True)
    for idx, optimizer in enumerate(strategy.optimizers):
        optimizer = getattr(optimizer, "_optimizer", optimizer)
        optim_state = {f"optimizer_{idx}": flat_optimizer_state(module, optimizer)}
        _distributed_checkpoint_load(optim_state, path)
        set_optimizer_state_dict(module, optimizer, optim_state_dict=optim_state[f"optimizer_{idx}"], options=opts)
    return torch.load(path / _METADATA_FILENAME, weights_only=weights_only)


def load_checkpoint(
    strategy: Any, checkpoint_path: Any, weights_only: Optional[bool], fallback: Callable[..., dict[str, Any]]
) -> dict[str, Any]:
    """The strategy's ``load_checkpoint``: a DCP folder through :func:`load_sharded_checkpoint`, else ``fallback``.

    ``weights_only`` defaults to True: never unpickle arbitrary objects from a checkpoint's metadata.

    Example::

        >>> load_checkpoint(strategy, "ckpts/last.ckpt", None, super_load)  # doctest: +SKIP
    """
    from lightning.fabric.strategies.model_parallel import _is_sharded_checkpoint

    weights_only = True if weights_only is None else weights_only
    if strategy._save_distributed_checkpoint and _is_sharded_checkpoint(Path(strategy.broadcast(checkpoint_path))):
        # optimizer states keyed by parameter FQN: loads at any pp / layout
        return load_sharded_checkpoint(strategy, checkpoint_path, weights_only)
    return fallback(checkpoint_path, weights_only=weights_only)


def optimizer_state(strategy: Any, optimizer: Any, fallback: Callable[[Any], dict[str, Any]]) -> dict[str, Any]:
    """The strategy's ``optimizer_state``: FQN-keyed under DCP (pipeline stages' states do not collide), else ``fallback``.

    Example::

        >>> optimizer_state(strategy, optimizer, super_state)  # doctest: +SKIP
    """
    if strategy._save_distributed_checkpoint:
        return flat_optimizer_state(strategy.model, optimizer)
    return fallback(optimizer)


def consolidate_checkpoint(
    checkpoint_dir: str | os.PathLike, output: str | os.PathLike | None = None, *, strip_prefix: str = ""
) -> dict[str, torch.Tensor]:
    """Read a sharded checkpoint's model weights into one ``{name: tensor}`` dict; save it if ``output``.

    ``strip_prefix`` removes a leading module name (``"model."`` for a LightningModule whose network
    lives in ``self.model``) so the file loads straight into the bare network.
    """
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    path = Path(checkpoint_dir)
    if not (path / ".metadata").is_file():
        raise ValueError(
            f"consolidate_checkpoint: `{path}` is not a sharded (DCP) checkpoint folder: it has no `.metadata` file. "
            "Pass the folder `trainer.save_checkpoint` or ModelCheckpoint wrote."
        )
    with tempfile.TemporaryDirectory() as tmp:
        full = Path(tmp) / "full.pt"
        dcp_to_torch_save(path, full)
        state = torch.load(full, map_location="cpu", weights_only=True)
    model_state = state.get("state_dict")
    if not isinstance(model_state, dict):
        raise ValueError(f"consolidate_checkpoint: `{path}` holds no `state_dict` entry; keys: {sorted(state)}.")
    weights = {
        (k[len(strip_prefix):] if strip_prefix and k.startswith(strip_prefix) else k): v.detach().clone()
        for k, v in model_state.items()
        if isinstance(v, torch.Tensor)
    }
    if output is not None:
        torch.save(weights, output)
    return weights


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="sharded checkpoint folder (with a .metadata file)")
    parser.add_argument("output", help="file to write: {parameter name: tensor}, loadable with weights_only=True")
    parser.add_argument("--strip-prefix", default="", help="remove this prefix from every name, e.g. 'model.'")


def run_cli(args: Any) -> int:
    weights = consolidate_checkpoint(args.checkpoint, args.output, strip_prefix=args.strip_prefix)
    numel = sum(t.numel() for t in weights.values())
    print(f"wrote {len(weights)} tensors ({numel:,} elements) to {args.output}")
    return 0
