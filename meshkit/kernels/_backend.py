"""Which implementation a kernel call runs, input checks, and the DTensor helpers the ops share.

Backends:

- ``"triton"``: the Triton kernels. Compiled on CUDA; on CPU only when ``TRITON_INTERPRET=1`` was set
  before meshkit.kernels was imported (Triton decides at decoration time whether a kernel is interpreted).
- ``"reference"``: the torch reference (fp32 math, eager ops).

The default (``"auto"``) is Triton for CUDA tensors and for CPU tensors under the interpreter, the
reference otherwise. ``MESHKIT_KERNELS=reference|triton|auto`` or :func:`kernel_backend` override it.
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Iterator, Sequence

import torch
import torch.distributed as dist

try:  # Triton ships with Linux torch wheels only
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised on platforms without Triton
    triton = None  # type: ignore[assignment]
    tl = None  # type: ignore[assignment]
    HAS_TRITON = False

# Read once: @triton.jit returns an interpreted function only if this was set when the kernel was defined.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_BACKENDS = ("auto", "triton", "reference")
_local = threading.local()


def _requested() -> str:
    name = getattr(_local, "backend", None) or os.environ.get("MESHKIT_KERNELS", "auto")
    if name not in _BACKENDS:
        raise ValueError(f"meshkit.kernels: `MESHKIT_KERNELS={name!r}` is not one of {_BACKENDS}; unset it or pick one.")
    return name


@contextlib.contextmanager
def kernel_backend(name: str) -> Iterator[None]:
    """Run meshkit kernels with ``name`` ("auto", "triton" or "reference") inside the block (this thread).

    Example::

        >>> import torch
        >>> from meshkit.kernels import kernel_backend, swiglu
        >>> with kernel_backend("reference"):
        ...     swiglu(torch.zeros(2, 3), torch.ones(2, 3)).sum().item()
        0.0
    """
    if name not in _BACKENDS:
        raise ValueError(f"kernel_backend: `name={name!r}` is not one of {_BACKENDS}.")
    old = getattr(_local, "backend", None)
    _local.backend = name
    try:
        yield
    finally:
        _local.backend = old


def use_triton(t: torch.Tensor) -> bool:
    """True when a kernel on tensor ``t`` should run the Triton code (see the module docstring)."""
    name = _requested()
    if name == "reference" or not HAS_TRITON:
        return False
    runnable = t.is_cuda or (INTERPRET and t.device.type == "cpu")
    if name == "triton" and not runnable:
        raise ValueError(
            f"meshkit.kernels: backend 'triton' was requested for a tensor on `device={t.device}`, but Triton runs "
            "there only with TRITON_INTERPRET=1 set before import (CPU) or on CUDA; use 'auto' or 'reference'."
        )
    return runnable


def num_programs(t: torch.Tensor, rows: int) -> int:
    """Programs for kernels that loop over rows: a few per SM on CUDA, a handful under the interpreter."""
    if t.is_cuda:
        return max(1, min(rows, 4 * torch.cuda.get_device_properties(t.device).multi_processor_count))
    return max(1, min(rows, 4))


def block_size(n: int, cap: int = 65536) -> int:
    """The power of two >= n used as a Triton block; ``cap`` bounds register use."""
    return min(cap, triton.next_power_of_2(max(1, n)) if HAS_TRITON else 1 << max(0, (n - 1).bit_length()))


def warps(block: int) -> int:
    """num_warps for a row kernel over ``block`` elements: ~256 elements a warp, 4 to 16 warps."""
    return max(4, min(16, block // 256))


def check_float(name: str, t: torch.Tensor, fn: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{fn}: `{name}` must be a torch.Tensor, got {type(t).__name__}.")
    if t.dtype not in SUPPORTED_DTYPES:
        raise ValueError(
            f"{fn}: `{name}.dtype={t.dtype}` is not supported; use float32, float16 or bfloat16 (cast with .to())."
        )


def check_same(fn: str, names: Sequence[str], tensors: Sequence[torch.Tensor], what: str) -> None:
    vals = [getattr(t, what) for t in tensors]
    if any(v != vals[0] for v in vals):
        desc = ", ".join(f"`{n}.{what}={v}`" for n, v in zip(names, vals))
        raise ValueError(f"{fn}: {desc} must be equal.")


# ----------------------------------------------------------------------------------------------- DTensor


def is_dtensor(t: object) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


class _AllReduceGrad(torch.autograd.Function):
    """Identity forward; backward sums the gradient over ``groups`` (each process group in turn)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, groups: tuple) -> torch.Tensor:  # type: ignore[override]
        ctx.groups = groups
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        grad = grad.contiguous().clone()
        for group in ctx.groups:
            dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=group)
        return grad, None


def all_reduce_grad(x: torch.Tensor, groups: Sequence[dist.ProcessGroup]) -> torch.Tensor:
    """``x`` unchanged, its gradient summed over ``groups`` in backward (no-op for no groups)."""
    return _AllReduceGrad.apply(x, tuple(groups)) if groups else x
