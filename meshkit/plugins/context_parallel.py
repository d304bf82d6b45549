"""Context parallelism: sequence sharding and ring / all-gather / Ulysses attention over a cp group.

Each of the ``cp`` ranks of a cp group holds ``T / cp`` tokens of every sequence. In the
``"load_balanced"`` layout the sequence is cut into ``2·cp`` chunks and rank r holds chunks r and
2·cp−1−r, so every rank does the same causal-attention work; ``"contiguous"`` gives rank r chunk r
of ``cp``. Attention runs on those shards with one of three schemes (``attention=``):

- ``"ring"``: K/V blocks travel around the group by isend/irecv while the block in hand is attended;
  partial outputs merge by log-sum-exp; backward sends the dK/dV accumulators around the ring.
  Sends per rank per layer: forward (cp−1)·|K,V|_local, backward (cp−1)·|K,V| + cp·|dK,dV|.
- ``"allgather"``: all-gather K/V, attend with the local queries, reduce-scatter dK/dV (Llama 3).
- ``"ulysses"``: all-to-all from sequence-sharded to head-sharded, full attention on H/cp heads,
  all-to-all back (needs ``num_heads % cp == 0`` and ``num_kv_heads`` a multiple or divisor of cp).

Rotary embeddings must use each token's *global* position: :func:`shard_batch` returns them, and
:func:`apply_context_parallel` feeds them to models that were not given any.

Example (2 ranks, run with torchrun)::

    >>> import torch, torch.distributed as dist                       # doctest: +SKIP
    >>> from torch.distributed.device_mesh import init_device_mesh
    >>> from meshkit.plugins.context_parallel import context_parallel_attention, shard_sequence
    >>> mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    >>> q = k = v = torch.randn(1, 4, 16, 8)                              # full (B, H, T, D), same on all ranks
    >>> ql, kl, vl = (shard_sequence(t, mesh.get_local_rank(), 2, dim=2) for t in (q, k, v))
    >>> out = context_parallel_attention(ql, kl, vl, mesh, attention="ring")  # (1, 4, 8, 8): this rank's rows
"""

from __future__ import annotations

import inspect
import itertools
import math
from typing import Any, Callable, Union

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.overrides import TorchFunctionMode

from meshkit.plugins import _cp_attention as _impl

__all__ = [
    "CP_ATTENTIONS",
    "CP_LAYOUTS",
    "context_parallel_attention",
    "shard_sequence",
    "gather_sequence",
    "sequence_positions",
    "shard_batch",
    "apply_context_parallel",
]

CP_ATTENTIONS: tuple[str, ...] = _impl.VARIANTS
CP_LAYOUTS: tuple[str, ...] = _impl.LAYOUTS
Group = Union[ProcessGroup, DeviceMesh]


def _group(group: Group) -> ProcessGroup:
    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ValueError(
                f"context_parallel: the cp mesh must be 1-D, got `mesh.ndim={group.ndim}`; pass mesh['cp']."
            )
        return group.get_group()
    return group


# ---- attention -----------------------------------------------------------------------------------------
def _check_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: int, attention: str, layout: str) -> None:
    if attention not in CP_ATTENTIONS:
        raise ValueError(f"context_parallel_attention: `attention={attention!r}` is not one of {CP_ATTENTIONS}.")
    if q.dim() != 4 or k.dim() != 4 or v.shape != k.shape:
        raise ValueError(
            "context_parallel_attention: q, k, v must be (B, H, T_local, D) with k and v the same shape; got "
            f"`q.shape={tuple(q.shape)}`, `k.shape={tuple(k.shape)}`, `v.shape={tuple(v.shape)}`."
        )
    if q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:] or q.shape[1] % k.shape[1]:
        raise ValueError(
            f"context_parallel_attention: `q.shape={tuple(q.shape)}` and `k.shape={tuple(k.shape)}` must share B, "
            "T_local and D, and the kv heads must divide the query heads."
        )
    _impl.check_layout(cp * q.shape[2], cp, layout, "seq_len")
    if attention == "ulysses":
        h, hkv = q.shape[1], k.shape[1]
        if h % cp or (hkv % cp and cp % hkv):
            raise ValueError(
                f"context_parallel_attention: `attention='ulysses'` with `cp={cp}` needs `num_heads={h}` divisible "
                f"by cp and `num_kv_heads={hkv}` either divisible by cp or dividing it (kv heads are then replicated). "
                "Use attention='ring' or 'allgather', or a cp that fits the heads."
            )


def context_parallel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: Group,
    *,
    causal: bool = True,
    attention: str = "ring",
    layout: str = "load_balanced",
    scale: float | None = None,
) -> torch.Tensor:
    """Scaled dot-product attention of sequence-sharded q (B, H, T/cp, D), k, v (B, Hkv, T/cp, D) over ``group``.

    Returns this rank's rows of the full-sequence attention, (B, H, T/cp, D), differentiable in q, k, v.
    ``group`` is the cp ProcessGroup or a 1-D DeviceMesh; every rank of it must call with the same
    shapes and options. ``layout`` says how the shards were cut (see :func:`shard_sequence`).
    Errors in the arguments are raised before any communication.

    Example (on every rank of a 1-D cp mesh ``mesh``)::

        >>> out = context_parallel_attention(q_local, k_local, v_local, mesh, attention="allgather")  # doctest: +SKIP
    """
    pg = _group(group)
    cp = dist.get_world_size(pg)
    _check_attention(q, k, v, cp, attention, layout)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if attention == "ulysses":
        return _impl.ulysses_attention(q, k, v, pg, causal, layout, scale)
    fn = _impl.RingAttention if attention == "ring" else _impl.AllGatherAttention
    return fn.apply(q, k, v, pg, causal, layout, scale)


# ---- sequence sharding ------------------------------------------------------------------------------------
def shard_sequence(x: torch.Tensor, cp_rank: int, cp: int, dim: int = 1, layout: str = "load_balanced") -> torch.Tensor:
    """This rank's shard of the full tensor ``x`` along ``dim`` (rank r: chunks r and 2cp-1-r, or chunk r).

    Example::

        >>> shard_sequence(torch.arange(8), cp_rank=1, cp=2, dim=0).tolist()
        [2, 3, 4, 5]
        >>> shard_sequence(torch.arange(8), cp_rank=1, cp=2, dim=0, layout="contiguous").tolist()
        [4, 5, 6, 7]
    """
    seq_len = x.shape[dim]
    _impl.check_layout(seq_len, cp, layout, f"x.shape[{dim}]")
    if not 0 <= cp_rank < cp:
        raise ValueError(f"shard_sequence: `cp_rank={cp_rank}` must be in [0, cp={cp}).")
    t_loc = seq_len // cp
    idx = _impl.layout_index(seq_len, cp, layout, device=x.device)[cp_rank * t_loc : (cp_rank + 1) * t_loc]
    return x.index_select(dim, idx)


def gather_sequence(x: torch.Tensor, group: Group, dim: int = 1, layout: str = "load_balanced") -> torch.Tensor:
    """Inverse of :func:`shard_sequence`: all-gather the shards of ``group`` and restore the natural order."""
    pg = _group(group)
    cp = dist.get_world_size(pg)
    _impl.check_layout(cp * x.shape[dim], cp, layout, f"cp*x.shape[{dim}]")
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(cp)]
    dist.all_gather(parts, x, group=pg, async_op=True).wait(timeout=_impl.P2P_TIMEOUT)
    full = torch.cat(parts, dim=dim)
    order = torch.argsort(_impl.layout_index(full.shape[dim], cp, layout, device=x.device))
    return full.index_select(dim, order)


def sequence_positions(
    seq_len: int, cp_rank: int, cp: int, layout: str = "load_balanced", device: Any = None
) -> torch.Tensor:
    """(seq_len / cp,) global positions of this rank's tokens, for rotary embeddings.

    Example::

        >>> sequence_positions(8, cp_rank=0, cp=2).tolist()
        [0, 1, 6, 7]
    """
    return shard_sequence(torch.arange(seq_len, device=device), cp_rank, cp, dim=0, layout=layout)


_POSITION_KEYS = ("positions", "position_ids")


def shard_batch(batch: Any, cp_mesh: Group, seq_dim: int = 1, layout: str = "load_balanced") -> dict[str, torch.Tensor]:
    """This cp rank's part of a batch: ``{"input_ids", "labels", "positions", ...}`` sharded along ``seq_dim``.

    ``batch`` is a dict with ``input_ids`` (and usually ``labels``; ``positions``/``position_ids`` if the data
    carries them) or a (B, T+1) token tensor, split into inputs ``[:, :-1]`` and labels ``[:, 1:]``.
    Every tensor entry whose size at ``seq_dim`` equals the sequence length is sharded; ``positions``
    (B, T/cp) hold the global positions of the local tokens. With ``cp == 1`` nothing is cut.

    Example::

        >>> import torch.distributed as dist
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> out = shard_batch(torch.arange(9)[None], dist.group.WORLD)
        >>> out["input_ids"].tolist(), out["labels"].tolist(), out["positions"].tolist()
        ([[0, 1, 2, 3, 4, 5, 6, 7]], [[1, 2, 3, 4, 5, 6, 7, 8]], [[0, 1, 2, 3, 4, 5, 6, 7]])
        >>> dist.destroy_process_group()
    """
    pg = _group(cp_mesh)
    cp, rank = dist.get_world_size(pg), dist.get_rank(pg)
    if isinstance(batch, torch.Tensor):
        n = batch.shape[seq_dim] - 1
        batch = {"input_ids": batch.narrow(seq_dim, 0, n), "labels": batch.narrow(seq_dim, 1, n)}
    elif not isinstance(batch, dict) or "input_ids" not in batch:
        raise ValueError(
            f"shard_batch: `batch` must be a token tensor or a dict with 'input_ids', got {type(batch).__name__}"
            + (f" with keys {sorted(batch)}" if isinstance(batch, dict) else "")
            + "."
        )
    tokens = batch["input_ids"]
    seq_len = tokens.shape[seq_dim]
    _impl.check_layout(seq_len, cp, layout, f"input_ids.shape[{seq_dim}]")
    out = dict(batch)
    if not any(key in batch for key in _POSITION_KEYS):
        shape = tokens.shape[: seq_dim + 1]
        out["positions"] = torch.arange(seq_len, device=tokens.device).expand(shape)
    for key, value in out.items():
        if isinstance(value, torch.Tensor) and value.dim() > seq_dim and value.shape[seq_dim] == seq_len:
            out[key] = shard_sequence(value, rank, cp, seq_dim, layout)
    if "position_ids" in out and "positions" not in out:
        out["positions"] = out["position_ids"]
    return out


# ---- model integration ------------------------------------------------------------------------------------
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
    group = _group(cp_mesh)
    hf_models = _outermost(model, lambda m: hasattr(getattr(m, "config", None), "_attn_implementation"))
    for hf_model in hf_models:
        _use_hf_attention(hf_model, group, attention, layout)
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
    return next((k for k in _POSITION_KEYS if k in params), None)


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
