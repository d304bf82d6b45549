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

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

__all__ = ["find_blocks", "apply_fsdp", "apply_fsdp_stages", "mixed_precision_policy", "clip_grad_norm_"]

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


def _root_units(model: nn.Module) -> list[list[nn.Module]]:
    """The root's unsharded children holding trainable parameters; children sharing a parameter (a tied
    embedding and LM head side by side) form one unit, so the tied parameter is sharded once."""
    units: list[list[nn.Module]] = []
    owner: dict[int, list[nn.Module]] = {}
    for _, child in model.named_children():
        if isinstance(child, FSDPModule) or not any(p.requires_grad for p in child.parameters()):
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
