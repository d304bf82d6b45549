"""FSDP2 (``fully_shard``) per block and root, the blocks it shards, mixed precision, gradient clipping.

:func:`meshkit.plugins.parallelize.parallelize` calls ``fully_shard`` last, after TP, CP,
activation checkpointing and compile. Each step keeps module and parameter names unchanged, so
checkpoints load across layouts and settings.

Example::

    >>> from meshkit.models import LlamaConfig, Transformer
    >>> from meshkit.plugins.fsdp import find_blocks
    >>> [n for n, _ in find_blocks(Transformer(LlamaConfig.tiny()))]
    ['layers.0', 'layers.1', 'layers.2', 'layers.3']
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

__all__ = [
    "find_blocks", "apply_fsdp", "apply_fsdp_stages", "mixed_precision_policy", "clip_grad_norm_", "reshard",
    "unsynced_parameters", "stale_optimizer_parameters",
]

SUPPORTED_PRECISION = ("32-true", "bf16-mixed", "bf16-true")


def find_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The repeated blocks: children of the largest ModuleList/ModuleDict whose entries share one class."""
    best: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
            children = list(module.named_children())
            if len(children) >= 2 and len({type(c) for _, c in children}) == 1 and len(children) > len(best):
                best = [(f"{name}.{n}" if name else n, c) for n, c in children]
    return best


def mixed_precision_policy(precision: str) -> MixedPrecisionPolicy | None:
    """FSDP2 policy for a Lightning precision string; raises for unsupported ones."""
    if precision not in SUPPORTED_PRECISION:
        raise ValueError(
            f"NDParallelStrategy: `precision={precision!r}` is not supported; use one of {SUPPORTED_PRECISION} "
            "(fp16 needs a gradient scaler that FSDP2 sharded gradients do not have; use bf16)."
        )
    if precision == "bf16-mixed":
        # Compute in bf16, reduce gradients in fp32, keep fp32 master weights.
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return None


def apply_fsdp(
    model: nn.Module,
    blocks: list[tuple[str, nn.Module]],
    mesh: DeviceMesh,
    *,
    mp_policy: MixedPrecisionPolicy | None = None,
    reshard_after_forward: bool = True,
) -> None:
    """``fully_shard`` each block, then each direct child of ``model`` holding parameters (the roots)."""
    kwargs = _shard_kwargs(mesh, mp_policy, reshard_after_forward)
    for _, block in blocks:
        fully_shard(block, **kwargs)
    if any(True for _ in model.parameters(recurse=False)):
        raise ValueError(
            f"NDParallelStrategy: `{type(model).__name__}` holds parameters directly "
            f"({[n for n, _ in model.named_parameters(recurse=False)]}); the automatic path shards submodules. "
            "Move them into a submodule, or write `configure_model` and call `fully_shard` yourself."
        )
    for unit in _root_units(model):
        # The root's last all-gather need not be resharded: backward starts with it.
        fully_shard(unit if len(unit) > 1 else unit[0], **{**kwargs, "reshard_after_forward": False})


def _holds_unsharded(module: nn.Module) -> bool:
    """Whether ``module`` holds a trainable parameter outside the FSDP units inside it."""
    if isinstance(module, FSDPModule):
        return False
    return any(p.requires_grad for p in module.parameters(recurse=False)) or any(
        _holds_unsharded(c) for c in module.children())


def _root_units(model: nn.Module) -> list[list[nn.Module]]:
    """The root's unsharded children holding trainable parameters; children sharing a parameter (a tied
    embedding and LM head side by side) form one unit, so the tied parameter is sharded once."""
    units: list[list[nn.Module]] = []
    owner: dict[int, list[nn.Module]] = {}
    for _, child in model.named_children():
        if not _holds_unsharded(child):  # e.g. the ModuleDict of already sharded blocks (no forward of its own)
            continue
        joined = [owner[id(p)] for _, p in child.named_parameters(remove_duplicate=False) if id(p) in owner]
        unit = joined[0] if joined else []
        if not joined:
            units.append(unit)
        unit.append(child)
        for p in child.parameters():
            owner[id(p)] = unit
    return units


def apply_fsdp_stages(views: list[nn.Module], mesh: DeviceMesh, *, mp_policy: MixedPrecisionPolicy | None = None) -> None:
    """Pipeline stages: ``fully_shard`` each stage view's blocks, then the view itself as root.

    ``reshard_after_forward=False``: a stage runs forward several times before backward. The views
    share one rank module (each block sits in one view); a block already sharded is not sharded again.
    """
    kwargs = _shard_kwargs(mesh, mp_policy, reshard_after_forward=False)
    for view in views:
        for _, block in find_blocks(view):
            if not isinstance(block, FSDPModule):
                fully_shard(block, **kwargs)
        fully_shard(view, **kwargs)


def _shard_kwargs(mesh: DeviceMesh, mp_policy: MixedPrecisionPolicy | None, reshard_after_forward: bool) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    return kwargs


@torch.no_grad()
def clip_grad_norm_(parameters: list[nn.Parameter], max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Clip gradients by their global norm over every mesh axis; returns the total norm (before clipping).

    Works when gradients live on different meshes (TP-sharded weights on (dp, tp), norms on (dp,)),
    where ``torch.nn.utils.clip_grad_norm_`` cannot stack their norms: each mesh group's norm is
    reduced to a full tensor once, then the groups are combined.
    """
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    groups: dict[Any, list[torch.Tensor]] = {}
    for g in grads:
        groups.setdefault(g.device_mesh if isinstance(g, DTensor) else None, []).append(g)
    norms = []
    for mesh, group in groups.items():
        n = torch.nn.utils.get_total_norm(group, norm_type=norm_type)
        norms.append(n.full_tensor() if isinstance(n, DTensor) else n)
    total = torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms]), ord=norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    # Scale the local shards in place (foreach ops on DTensors with a plain scalar tensor do not, torch 2.13).
    for g in grads:
        (g.to_local() if isinstance(g, DTensor) else g).mul_(coef.to(g.device))
    return total


def reshard(module: nn.Module) -> None:
    """Free every FSDP unit's gathered parameters in ``module`` (no collective), keeping the dp-sharded ones.

    After an eval forward the root unit (``reshard_after_forward=False``) still holds its unsharded parameters;
    :func:`unsynced_parameters` reads the sharded ones.
    """
    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def unsynced_parameters(module: nn.Module, dp_ranks: set[int], stages: Sequence[nn.Module] = ()) -> list[str]:
    """The trainable parameters of ``module`` whose gradients nothing reduces over the data-parallel ranks ``dp_ranks``.

    A parameter is synchronized when a ``fully_shard`` unit (an ``FSDPModule`` at or above one of its owners)
    manages it over a mesh spanning every rank of ``dp_ranks``, or a ``DistributedDataParallel`` wraps it. Any
    other trainable parameter (a ``configure_model`` that sharded nothing, or sharded over ``tp`` only) gets
    each dp rank's own gradient: the ranks' copies drift apart without an error.

    A pure query: it reads the parameters registered now, so call it on resharded units (:func:`reshard`), the
    state FSDP keeps between steps; an unsharded unit registers its gathered, tp-only parameters instead.

    ``stages``: under pp the pipeline's stage views, sharded outside ``module``'s tree (each view shares this
    rank's blocks, embedding and head with ``module`` and is the FSDP root of its stage): a parameter a view's
    unit manages is synchronized too; one no view holds (a LightningModule's own parameter beside the split
    model) is not.
    """
    from torch.distributed.tensor import DTensor
    from torch.nn.parallel import DistributedDataParallel

    synced: dict[int, bool] = {}
    names: dict[int, str] = {}

    def walk(m: nn.Module, prefix: str, wrapped: bool) -> None:
        wrapped = wrapped or isinstance(m, (FSDPModule, DistributedDataParallel))
        for name, p in m.named_parameters(recurse=False):
            if not p.requires_grad:
                continue
            names.setdefault(id(p), f"{prefix}{name}")
            spans = not isinstance(p, DTensor) or dp_ranks <= set(p.device_mesh.mesh.flatten().tolist())
            synced[id(p)] = synced.get(id(p), False) or (wrapped and spans)
        for child_name, child in m.named_children():
            walk(child, f"{prefix}{child_name}.", wrapped)

    walk(module, "", False)  # first: the names are the module's own (the views' paths are the same or shorter)
    for view in stages:
        walk(view, "", False)
    return [names[i] for i, ok in synced.items() if not ok]


def stale_optimizer_parameters(module: nn.Module, optimizers: list[Any]) -> list[tuple[int, str, int, int]]:
    """``(index, class, stale, total)`` for each optimizer holding parameters that are not ``module``'s any more.

    Sharding replaces every parameter (``fully_shard`` and ``parallelize_module`` make DTensor parameters), so an
    optimizer built before it (in ``__init__``) steps tensors the model no longer uses: it trains nothing.
    """
    current = {id(p) for p in module.parameters()}
    out = []
    for i, optimizer in enumerate(optimizers):
        optimizer = getattr(optimizer, "_optimizer", optimizer)
        held = [p for group in optimizer.param_groups for p in group["params"]]
        stale = sum(id(p) not in current for p in held)
        if stale:
            out.append((i, type(optimizer).__name__, stale, len(held)))
    return out
