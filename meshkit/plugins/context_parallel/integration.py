"""Model integration of context parallelism: route a model's attention to cp attention, feed global positions.

:func:`apply_context_parallel` swaps attention in place: a ``TorchFunctionMode`` scoped to each attention
module's forward for torchtitan-style models, a registered ``AttentionInterface`` function for
transformers models; forward pre-hooks fill in the global positions of the local tokens. The top layer
of :mod:`meshkit.plugins.context_parallel` (imports :mod:`.layout` and :mod:`.attention`).

Example::

    >>> model = apply_context_parallel(Transformer(LlamaConfig.tiny()), mesh["cp"])  # doctest: +SKIP
"""

from __future__ import annotations

import inspect
import itertools
from typing import Any, Callable

import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup
from torch.overrides import TorchFunctionMode

from meshkit.loss import num_items
from meshkit.plugins.context_parallel.attention import CP_ATTENTIONS, context_parallel_attention
from meshkit.plugins.context_parallel.layout import (
    CP_LAYOUTS,
    POSITION_KEYS,
    Group,
    process_group,
    sequence_positions,
)

__all__ = ["apply_context_parallel"]


class _SDPAToCP(TorchFunctionMode):
    """Routes ``F.scaled_dot_product_attention`` calls to :func:`context_parallel_attention` while active."""

    def __init__(self, group: ProcessGroup, attention: str, layout: str) -> None:
        super().__init__()
        self.group, self.attention, self.layout = group, attention, layout

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
        params = dict(zip(names, args))
        params.update(kwargs)
        if params.get("attn_mask") is not None or params.get("dropout_p", 0.0):
            raise ValueError(
                "apply_context_parallel: the model calls scaled_dot_product_attention with an `attn_mask` or "
                "`dropout_p>0`; context-parallel attention supports causal or full attention without dropout only."
            )
        return context_parallel_attention(
            params["query"], params["key"], params["value"], self.group,
            causal=bool(params.get("is_causal", False)), attention=self.attention, layout=self.layout,
            scale=params.get("scale"),
        )  # fmt: skip


def _hf_attention_fn(group: ProcessGroup, attention: str, layout: str) -> Callable:
    """An attention function for transformers' AttentionInterface (signature of its sdpa_attention_forward)."""

    def forward(module: nn.Module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kw):
        window, seq_len = kw.get("sliding_window"), dist.get_world_size(group) * query.shape[2]
        if window is not None and window < seq_len:
            raise ValueError(
                f"apply_context_parallel: {type(module).__name__} attends within `sliding_window={window}` tokens, but "
                f"the sequences are {seq_len} long and context-parallel attention attends to every earlier token. "
                f"Train with sequences of at most {window} tokens, or set `config.sliding_window=None` (full causal "
                "attention) if that is the model you mean."
            )
        if attention_mask is not None or (dropout and module.training):
            raise ValueError(
                "apply_context_parallel: a transformers model passed an `attention_mask` or dropout>0 to context-"
                "parallel attention; only unpadded causal batches without attention dropout are supported."
            )
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        out = context_parallel_attention(
            query, key, value, group, causal=causal, attention=attention, layout=layout, scale=scaling
        )
        return out.transpose(1, 2).contiguous(), None  # (B, T, H, D), as sdpa_attention_forward returns

    return forward


_HF_NAMES = itertools.count()


def _position_hook(group: ProcessGroup, layout: str, key: str) -> Callable:
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if kwargs.get(key) is not None or len(args) > 1:
            return None
        tokens = args[0] if args else kwargs.get("input_ids", kwargs.get("inputs_embeds", kwargs.get("tokens")))
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        positions = sequence_positions(cp * tokens.shape[1], rank, cp, layout, device=tokens.device)
        kwargs[key] = positions[None].expand(tokens.shape[0], -1)
        return args, kwargs

    return hook


def _shifted_labels_hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """``labels=batch["input_ids"]`` or ``labels=batch["labels"]`` of a :func:`shard_batch` batch: pass the
    shifted labels as ``shift_labels`` (transformers would shift this rank's load-balanced shard otherwise),
    and the cp group's mean count of targets as ``num_items_in_batch`` (the ranks hold different counts when
    some targets are ignored, e.g. after each row's last token)."""
    labels = kwargs.get("labels")
    shifted = getattr(labels, "_meshkit_cp_shifted", None)
    if shifted is None or kwargs.get("shift_labels") is not None:
        return None
    kwargs["shift_labels"] = shifted
    if kwargs.get("num_items_in_batch") is None:
        kwargs["num_items_in_batch"] = num_items(labels)  # the cp group's targets / cp (shard_batch's record)
    return args, kwargs


def apply_context_parallel(
    model: nn.Module,
    cp_mesh: Group,
    attention: str = "ring",
    layout: str = "load_balanced",
    attention_modules: Callable[[str, nn.Module], bool] | None = None,
) -> nn.Module:
    """Make ``model`` attend over the whole sequence while each cp rank holds ``T / cp`` of it; in place.

    - transformers models (``config._attn_implementation``), at the root or inside (e.g. in a LightningModule):
      a meshkit attention function is registered in transformers' ``AttentionInterface`` and selected.
    - other models (torchtitan-style, e.g. :class:`meshkit.models.llama.Transformer`): inside each attention
      module's forward (classes named ``*Attention``, or those ``attention_modules(name, module)`` selects),
      calls to ``F.scaled_dot_product_attention`` go to :func:`context_parallel_attention`. The swap is a
      TorchFunctionMode scoped to those forwards, so activation-checkpoint recomputation sees it too.
    - a transformers ``...ForCausalLM`` called with ``labels=`` a :func:`shard_batch` batch's ``input_ids``
      or ``labels`` gets ``shift_labels=`` the batch's (already shifted) labels, so the HF idiom
      ``model(input_ids=ids, labels=ids).loss`` gives the one-process loss.
    - where the model (or its outermost submodule taking ``positions``/``position_ids``, e.g. a
      LightningModule's inner Transformer) is called without positions, they are filled with the global
      positions of the local tokens, so rotary embeddings are right.

    Feed it the batches of :func:`shard_batch` (same ``layout``). Returns ``model``.

    Example::

        >>> model = Transformer(LlamaConfig.tiny())                                  # doctest: +SKIP
        >>> model = apply_context_parallel(model, mesh["cp"], attention="ring")      # doctest: +SKIP
        >>> local = shard_batch(tokens, mesh["cp"])  # (B, T+1) tokens -> T/cp each  # doctest: +SKIP
        >>> logits = model(local["input_ids"], local["positions"])                   # doctest: +SKIP
    """
    if attention not in CP_ATTENTIONS:
        raise ValueError(f"apply_context_parallel: `attention={attention!r}` is not one of {CP_ATTENTIONS}.")
    if layout not in CP_LAYOUTS:
        raise ValueError(f"apply_context_parallel: `layout={layout!r}` is not one of {CP_LAYOUTS}.")
    group = process_group(cp_mesh)
    hf_models = _outermost(model, lambda m: hasattr(getattr(m, "config", None), "_attn_implementation"))
    for hf_model in hf_models:
        _use_hf_attention(hf_model, group, attention, layout)
        if hasattr(hf_model, "loss_function"):  # a ...ForCausalLM: `labels=` must not shift the local shard
            hf_model.register_forward_pre_hook(_shifted_labels_hook, with_kwargs=True)
    in_hf = {id(m) for hf_model in hf_models for m in hf_model.modules()}
    select = attention_modules or (lambda _name, m: type(m).__name__.endswith("Attention"))
    targets = [m for n, m in model.named_modules() if id(m) not in in_hf and select(n, m)]
    if not hf_models and not targets:
        raise ValueError(
            f"apply_context_parallel: found no attention module in {type(model).__name__} (no transformers model, "
            "no class named '*Attention'); pass `attention_modules=lambda name, module: ...` to choose them."
        )
    for module in targets:
        _install_mode(module, group, attention, layout)
    for module in _outermost(model, lambda m: _position_key(m) is not None):
        module.register_forward_pre_hook(_position_hook(group, layout, _position_key(module)), with_kwargs=True)
    return model


def _use_hf_attention(model: nn.Module, group: ProcessGroup, attention: str, layout: str) -> None:
    """Register a cp attention function with transformers and select it for ``model``."""
    from transformers import AttentionInterface

    name = f"meshkit_cp_{attention}_{next(_HF_NAMES)}"
    AttentionInterface.register(name, _hf_attention_fn(group, attention, layout))
    if hasattr(model, "set_attn_implementation"):  # transformers >= 4.56: also updates sub-configs
        model.set_attn_implementation(name)
    else:
        model.config._attn_implementation = name


def _position_key(module: nn.Module) -> str | None:
    params = inspect.signature(module.forward).parameters
    return next((k for k in POSITION_KEYS if k in params), None)


def _outermost(model: nn.Module, pred: Callable[[nn.Module], bool]) -> list[nn.Module]:
    """The modules satisfying ``pred`` with no ancestor satisfying it (e.g. a LightningModule's inner
    Transformer taking ``positions``, or a transformers ...ForCausalLM but not its inner model)."""
    found, todo = [], [model]
    while todo:
        module = todo.pop(0)
        if pred(module):
            found.append(module)
        else:
            todo.extend(module.children())
    return found


def _install_mode(module: nn.Module, group: ProcessGroup, attention: str, layout: str) -> None:
    active: list[_SDPAToCP] = []

    def enter(_m: nn.Module, _args: Any) -> None:
        mode = _SDPAToCP(group, attention, layout)
        mode.__enter__()
        active.append(mode)

    def leave(_m: nn.Module, _args: Any, _out: Any) -> None:
        active.pop().__exit__(None, None, None)

    module.register_forward_pre_hook(enter)
    module.register_forward_hook(leave, always_call=True)
