"""Materialize a model built on the meta device (``trainer.init_module(empty_init=True)``) the way its own init would.

``module.to_empty(device)`` gives every parameter and buffer uninitialized memory; Lightning then calls each
module's ``reset_parameters()`` and only warns for the rest. That leaves what no ``reset_parameters`` covers as
garbage: a transformers Llama's rotary ``inv_freq`` (a buffer computed in ``__init__``) came out as 1.8e20, its
RMSNorm weights likewise, and the fit completed with a NaN loss. :func:`materialize`:

1. keeps what was not on the meta device (``to_empty`` would discard it, an init overwrite it): restored last;
2. fills every materialized float tensor with NaN (integers with a sentinel), so nothing uninitialized can pass
   for a value;
3. runs the model's own init as its build ran it (:func:`_replay_init`): children first, each module's
   ``reset_parameters()``, and at each transformers ``PreTrainedModel`` its ``initialize_weights`` sweep (rotary
   tables from the config, norms, ``initializer_range`` draws, GPT-2's scaled residual projections); a tied
   weight is drawn as the two tensors it was while being built and keeps its first holder's values, and stays
   tied (``to_empty`` unties plain tensors). Each random fill of a sharded parameter draws the whole tensor and
   keeps this rank's part (:func:`_whole_draws`; DTensor alone made every shard a copy of the first). From the
   build's RNG state, on every rank, one process or sharded, the build's values come out bit for bit, where the
   build draws only in those inits;
4. refuses, on every rank alike (the verdicts are gathered), any tensor some part of which is still NaN or the
   sentinel: it names the tensors, their modules and the fix.

Example::

    >>> from meshkit.plugins.materialize import materialize
    >>> materialize(model, torch.device("cpu"))  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from typing import Any, Iterator

import torch
from torch import nn

__all__ = ["materialize", "has_meta_tensors"]

_SENTINEL = -0x5EED_F00D  # what an integer tensor holds until something initializes it


def has_meta_tensors(module: nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` is on the meta device."""
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


def _tensors(module: nn.Module) -> Iterator[tuple[str, nn.Module, str, torch.Tensor]]:
    """``(qualified name, owner, attribute, tensor)`` for every parameter and buffer, each tensor once."""
    seen: set[int] = set()
    for prefix, owner in module.named_modules():
        for attr, t in (*owner._parameters.items(), *owner._buffers.items()):
            if t is None or id(t) in seen:
                continue
            seen.add(id(t))
            yield (f"{prefix}.{attr}" if prefix else attr), owner, attr, t


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _poison(t: torch.Tensor) -> None:
    local = _local(t)
    if local.is_floating_point() or local.is_complex():
        local.fill_(float("nan"))
    elif local.dtype != torch.bool:
        local.fill_(_SENTINEL if torch.iinfo(local.dtype).min <= _SENTINEL else torch.iinfo(local.dtype).max)


def _poisoned(t: torch.Tensor) -> bool:
    local = _local(t)
    if local.numel() == 0 or local.dtype == torch.bool:
        return False
    if local.is_floating_point() or local.is_complex():
        return bool(torch.isnan(local).any())
    value = _SENTINEL if torch.iinfo(local.dtype).min <= _SENTINEL else torch.iinfo(local.dtype).max
    return bool((local == value).any())


def _class_name(m: nn.Module) -> str:
    """The user's class name of ``m`` (``fully_shard`` makes ``FSDPTransformer`` out of ``Transformer``)."""
    from torch.distributed.fsdp import FSDPModule

    return next(c for c in type(m).__mro__ if not issubclass(c, FSDPModule)).__name__


def _shared(module: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """``(owner, attribute)`` of each parameter or buffer held by more than one module (a tied embedding and head)."""
    holders: dict[int, list[tuple[nn.Module, str]]] = {}
    for owner in module.modules():
        for table in (owner._parameters, owner._buffers):
            for attr, t in table.items():
                if t is not None:
                    holders.setdefault(id(t), []).append((owner, attr))
    return [h for h in holders.values() if len(h) > 1]


def _table(owner: nn.Module, attr: str) -> dict:
    return owner._parameters if attr in owner._parameters else owner._buffers


def _untie(module: nn.Module) -> list[tuple[nn.Module, str, torch.Tensor]]:
    """Give every later holder of a shared parameter or buffer its own poisoned scratch tensor; return what to put
    back. A tied weight was two tensors while the model was built (each module's init drew into its own) and was
    tied afterwards, the first holder's tensor kept (transformers' ``tie_weights``: ``lm_head.weight`` becomes
    ``embed_tokens.weight``): replaying the init on the scratch draws what was drawn then, and :func:`_retie` keeps
    the first holder's values, as the build did."""
    seen: set[int] = set()
    ties: list[tuple[nn.Module, str, torch.Tensor]] = []
    for owner in module.modules():
        for table in (owner._parameters, owner._buffers):
            for attr, t in list(table.items()):
                if t is None:
                    continue
                if id(t) not in seen:
                    seen.add(id(t))
                    continue
                scratch = torch.empty_like(t)
                _poison(scratch)
                table[attr] = nn.Parameter(scratch, t.requires_grad) if isinstance(t, nn.Parameter) else scratch
                ties.append((owner, attr, t))
    return ties


def _retie(ties: list[tuple[nn.Module, str, torch.Tensor]]) -> None:
    for owner, attr, t in ties:
        _table(owner, attr)[attr] = t


def _whole_draws() -> Any:
    """A dispatch mode in which each random fill of a DTensor draws the whole tensor, as one process draws it, and
    keeps this rank's part of it.

    DTensor fills each shard from the rank's own generator instead (torch's sharded RNG is CUDA-only): every rank
    starts from the same state, so on 4 gloo ranks the 4 dp shards of an embedding and the tp shards of every
    projection came out as copies of one another, and the RNG stream no longer matched one process's. The whole draw
    holds one full tensor at a time (the largest: the embedding) and advances every rank's generator as the build
    advanced it. It works at the aten level (``normal_``, ``uniform_``, ...), under ``nn.init``'s functions, which a
    ``TorchFunctionMode`` sees only from outside. ``TorchDispatchMode`` lives in the private
    ``torch.utils._python_dispatch`` (no public path; checked on torch 2.13)."""
    from torch.distributed.tensor import DTensor, distribute_tensor
    from torch.utils._python_dispatch import TorchDispatchMode

    aten = torch.ops.aten
    draws = {aten.normal_, aten.uniform_, aten.bernoulli_, aten.random_, aten.exponential_, aten.cauchy_,
             aten.log_normal_, aten.geometric_}  # what nn.init draws with (trunc_normal_: uniform_, mapped)

    class WholeDraws(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
            kwargs = kwargs or {}
            if getattr(func, "overloadpacket", None) not in draws or not isinstance(args[0], DTensor):
                return func(*args, **kwargs)
            t = args[0]
            local = t.to_local()
            whole = torch.empty(t.shape, dtype=t.dtype, device=local.device)
            func(whole, *args[1:], **kwargs)
            local.copy_(distribute_tensor(whole, t.device_mesh, t.placements, src_data_rank=None).to_local())
            return t

    return WholeDraws()


def _hf_base() -> type | None:
    transformers = sys.modules.get("transformers")  # none unless the model's code imported it
    return getattr(transformers, "PreTrainedModel", None)


def _replay_init(module: nn.Module) -> list[str]:
    """Run the init the model ran while it was built, in the order it ran, on the materialized tensors.

    Building a module runs its children's ``__init__`` first, each module's ``reset_parameters()`` at the end of
    its own (``nn.Linear``, ``nn.Embedding``), and a transformers ``PreTrainedModel``'s ``post_init`` at the end of
    its ``__init__``: ``initialize_weights``, children first, each module with the innermost ``PreTrainedModel``'s
    ``_initialize_weights`` (which skips modules an inner model already initialized). So: one post-order walk, a
    module's ``reset_parameters()`` after its children, and at each ``PreTrainedModel`` its own sweep. With the
    same RNG state as the build, one process draws the same values (tests/unit/test_materialize.py, every family
    of the model matrix). Returns the modules whose transformers init raised (e.g. a sharded padding row)."""
    base = _hf_base()
    failed: list[str] = []
    for m in module.modules():  # set by transformers on the meta build; stale for the memory given now
        if base is not None and "_is_hf_initialized" in m.__dict__:
            del m._is_hf_initialized

    def sweep(model: nn.Module) -> None:  # transformers' `initialize_weights` (smart_apply), failures per module
        custom = bool(getattr(model, "is_custom_code", lambda: False)())
        two_args = "is_custom_code" in inspect.signature(model._initialize_weights).parameters

        def apply(m: nn.Module, owner: nn.Module) -> None:
            for child in m.children():
                apply(child, child if isinstance(child, base) else owner)
            try:
                owner._initialize_weights(m, custom) if two_args else owner._initialize_weights(m)
            except Exception as e:  # noqa: BLE001 - e.g. indexing a sharded DTensor (an embedding's padding row)
                failed.append(f"{_class_name(m)} ({type(e).__name__}: {e})")

        guard = getattr(sys.modules.get("transformers.initialization"), "guard_torch_init_functions", None)
        with guard() if guard is not None else contextlib.nullcontext():
            apply(model, model)

    visited: set[int] = set()

    def build(m: nn.Module) -> None:
        if id(m) in visited:
            return
        visited.add(id(m))
        for child in m.children():
            build(child)
        if callable(reset := getattr(m, "reset_parameters", None)) and any(
                True for _ in (*m.parameters(recurse=False), *m.buffers(recurse=False))):
            reset()
        if base is not None and isinstance(m, base):
            sweep(m)

    build(module)
    return failed


@torch.no_grad()
def materialize(module: nn.Module, device: torch.device) -> None:
    """Give every meta parameter and buffer of ``module`` real memory on ``device``, initialized by the model's
    own init (steps in the module docstring); raise ``ValueError`` naming what nothing initialized, the same on
    every rank of the default process group (every rank calls it).
    """
    if not has_meta_tensors(module):
        return
    kept = {name: t.detach().to(device, copy=True) for name, _, _, t in _tensors(module) if not t.is_meta}
    was_meta = {name for name, _, _, t in _tensors(module) if t.is_meta}
    shared = _shared(module)
    module.to_empty(device=device)  # on the root: FSDP's sharded parameters stay DTensors
    for (first, first_attr), *rest in shared:  # to_empty gives each holder of a plain meta tensor its own copy
        for owner, attr in rest:
            _table(owner, attr)[attr] = _table(first, first_attr)[first_attr]
    for name, owner, attr, t in _tensors(module):
        if name in was_meta:
            _poison(t)
            if hasattr(t, "_is_hf_initialized"):  # set on the meta tensor by transformers' post_init: stale now
                del t._is_hf_initialized
    ties = _untie(module)
    try:
        with _whole_draws():
            failed = _replay_init(module)
    finally:
        _retie(ties)
    if failed:
        import warnings

        warnings.warn(
            f"meshkit: transformers' `_init_weights` failed on the sharded {failed[:3]}: what `reset_parameters()` "
            "wrote stands there (what neither initialized is refused below).", stacklevel=2)
    for name, _, _, t in _tensors(module):  # last: no init may overwrite what was never on the meta device
        if name in kept:
            _local(t).copy_(_local(kept[name]))
    missing = [(name, _class_name(owner)) for name, owner, _, t in _tensors(module)
               if name in was_meta and _poisoned(t)]
    missing = _agreed(missing)
    if missing:
        names = ", ".join(f"`{n}` ({cls})" for n, cls in missing[:5])
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        classes = sorted({cls for _, cls in missing})
        raise ValueError(
            f"meshkit: the model was built on the meta device (`empty_init=True`) and nothing initializes {names}{more} "
            f"once it is materialized: neither a `reset_parameters()` of {classes} nor the model's own init fills "
            "them, so training would start from uninitialized memory. Give those modules a `reset_parameters()` "
            "that computes them (meshkit calls it on each shard after `to_empty`), or build the model without "
            "`empty_init=True`."
        )


def _agreed(missing: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Every rank's findings together (a rank whose shard of a tensor is empty sees nothing wrong with it)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return missing
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, missing)
    return list(dict.fromkeys(tuple(x) for part in gathered for x in part))
