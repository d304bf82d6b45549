"""Shared helpers for the kernel tests: the tolerance table, relative errors, Triton-vs-reference runs."""

from __future__ import annotations

import collections
from typing import Callable, Sequence

import torch
from torch.overrides import TorchFunctionMode

from meshkit.kernels import _backend, kernel_backend

# Normwise relative error max|a - b| / max|b| allowed, per dtype. Measured on the shapes below:
# fp32 ~3e-7, fp16 ~2e-4 (one fp16 rounding of the output); a wrong formula gives O(1).
TOL = {torch.float32: 1e-5, torch.float16: 2e-3}
# Against an independent fp32 formula: in fp16 the kernels see the cotangent rounded to fp16 (the
# formula does not), measured up to 1.8e-3 on dx of RMSNorm; fp32 stays at TOL.
TOL_FORMULA = {torch.float32: 1e-5, torch.float16: 1e-2}
DTYPES = [torch.float32, torch.float16]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    assert a.shape == b.shape, (a.shape, b.shape)
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item()


def f32(ts: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [t.float() for t in ts]


def assert_close(actual: Sequence[torch.Tensor], expected: Sequence[torch.Tensor], tol: float, what: str = "") -> None:
    assert len(actual) == len(expected)
    for i, (a, b) in enumerate(zip(actual, expected)):
        assert a.dtype == b.dtype, f"{what}[{i}] dtype {a.dtype} != {b.dtype}"
        err = rel_err(a, b)
        assert err <= tol, f"{what}[{i}]: relative error {err:.3g} > {tol:g}"


def forward_backward(fn: Callable, inputs: Sequence[torch.Tensor], seed: int = 0) -> list[torch.Tensor]:
    """Outputs of fn(*inputs) and the gradients of sum(out * random cotangent) w.r.t. the inputs."""
    leaves = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
    out = fn(*leaves)
    outs = list(out) if isinstance(out, tuple) else [out]
    g = torch.Generator().manual_seed(seed)
    loss = sum((o.float() * torch.randn(o.shape, generator=g)).sum() for o in outs)
    grads = torch.autograd.grad(loss, [x for x in leaves if x.requires_grad])
    return [o.detach() for o in outs] + list(grads)


def triton_and_reference(fn: Callable, inputs: Sequence[torch.Tensor]) -> tuple[list, list]:
    """The same call on Triton's interpreter and on the torch reference."""
    assert _backend.INTERPRET, "tests/conftest.py must set TRITON_INTERPRET=1 before meshkit.kernels is imported"
    with kernel_backend("triton"):
        tri = forward_backward(fn, inputs)
    with kernel_backend("reference"):
        ref = forward_backward(fn, inputs)
    return tri, ref


class OpCounter(TorchFunctionMode):
    """Counts calls of meshkit's custom ops (``meshkit.<op>.default``) inside the block."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if name.startswith("meshkit."):
            self.counts[name.split(".")[1]] += 1
        return func(*args, **(kwargs or {}))
