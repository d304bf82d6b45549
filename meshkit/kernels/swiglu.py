"""SwiGLU: ``silu(gate) * up`` -- Triton kernels, torch reference, custom ops, autograd.

With ``s = sigmoid(gate)``: ``dgate = dy * up * s * (1 + gate * (1 - s))`` and ``dup = dy * gate * s``.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Partial

from ._backend import HAS_TRITON, check_float, check_same, is_dtensor, tl, triton, use_triton

__all__ = ["swiglu"]

_LAUNCH = {"BLOCK": 1024, "num_warps": 4}
"""Elements per program and warps of both elementwise kernels (also what the occupancy report measures)."""

if HAS_TRITON:

    @triton.jit
    def _swiglu_fwd_kernel(G, U, Y, n, BLOCK: tl.constexpr):
        offs = tl.cast(tl.program_id(0), tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        g = tl.cast(tl.load(G + offs, mask=mask, other=0.0), tl.float32)
        u = tl.cast(tl.load(U + offs, mask=mask, other=0.0), tl.float32)
        s = 1.0 / (1.0 + tl.exp(-g))
        tl.store(Y + offs, tl.cast(g * s * u, Y.dtype.element_ty), mask=mask)

    @triton.jit
    def _swiglu_bwd_kernel(DY, G, U, DG, DU, n, BLOCK: tl.constexpr):
        offs = tl.cast(tl.program_id(0), tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        dy = tl.cast(tl.load(DY + offs, mask=mask, other=0.0), tl.float32)
        g = tl.cast(tl.load(G + offs, mask=mask, other=0.0), tl.float32)
        u = tl.cast(tl.load(U + offs, mask=mask, other=0.0), tl.float32)
        s = 1.0 / (1.0 + tl.exp(-g))
        tl.store(DG + offs, tl.cast(dy * u * s * (1.0 + g * (1.0 - s)), DG.dtype.element_ty), mask=mask)
        tl.store(DU + offs, tl.cast(dy * g * s, DU.dtype.element_ty), mask=mask)


def _grid(n: int) -> tuple[int]:
    return (triton.cdiv(n, _LAUNCH["BLOCK"]),)


@torch.library.custom_op("meshkit::swiglu_fwd", mutates_args=())
def _swiglu_fwd(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for same-shape, same-dtype tensors (computed in fp32)."""
    gate, up = gate.contiguous(), up.contiguous()
    if not use_triton(gate):
        return (torch.nn.functional.silu(gate.float()) * up.float()).to(gate.dtype)
    y = torch.empty_like(gate)
    if gate.numel():
        _swiglu_fwd_kernel[_grid(gate.numel())](gate, up, y, gate.numel(), **_LAUNCH)
    return y


@_swiglu_fwd.register_fake
def _(gate, up):
    return torch.empty_like(gate)


@torch.library.custom_op("meshkit::swiglu_bwd", mutates_args=())
def _swiglu_bwd(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dgate, dup) of :func:`_swiglu_fwd`."""
    dy, gate, up = dy.contiguous(), gate.contiguous(), up.contiguous()
    if not use_triton(gate):
        g, u, d = gate.float(), up.float(), dy.float()
        s = torch.sigmoid(g)
        return (d * u * s * (1 + g * (1 - s))).to(gate.dtype), (d * g * s).to(up.dtype)
    dg, du = torch.empty_like(gate), torch.empty_like(up)
    if gate.numel():
        _swiglu_bwd_kernel[_grid(gate.numel())](dy, gate, up, dg, du, gate.numel(), **_LAUNCH)
    return dg, du


@_swiglu_bwd.register_fake
def _(dy, gate, up):
    return torch.empty_like(gate), torch.empty_like(up)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, dy):
    gate, up = ctx.saved_tensors
    return _swiglu_bwd(dy, gate, up)


_swiglu_fwd.register_autograd(_backward, setup_context=_setup_context)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` in one pass (fp32 inside), with autograd.

    DTensors keep their placements (both must share mesh and placements, e.g. colwise-sharded
    ``w1(x)`` and ``w3(x)`` under tensor parallelism).

    Example::

        >>> import torch
        >>> from meshkit.kernels import swiglu
        >>> swiglu(torch.zeros(3), torch.ones(3)).tolist()
        [0.0, 0.0, 0.0]
    """
    check_float("gate", gate, "swiglu")
    check_float("up", up, "swiglu")
    check_same("swiglu", ("gate", "up"), (gate, up), "shape")
    check_same("swiglu", ("gate", "up"), (gate, up), "dtype")
    if is_dtensor(gate) or is_dtensor(up):
        if not (is_dtensor(gate) and is_dtensor(up)) or gate.device_mesh != up.device_mesh:
            raise ValueError("swiglu: `gate` and `up` must both be DTensors on one mesh, or both plain tensors.")
        check_same("swiglu", ("gate", "up"), (gate, up), "placements")
        if any(isinstance(p, Partial) for p in gate.placements):
            raise ValueError(f"swiglu: `gate.placements={gate.placements}` is Partial; reduce it first.")
        y = _swiglu_fwd(gate.to_local(), up.to_local())
        return DTensor.from_local(y, gate.device_mesh, gate.placements, run_check=False,
                                  shape=gate.shape, stride=gate.stride())  # fmt: skip
    return _swiglu_fwd(gate, up)
