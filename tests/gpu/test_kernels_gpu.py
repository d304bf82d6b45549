"""Compiled Triton on CUDA vs the torch reference, fp32/fp16/bf16 (skipped without CUDA).

The interpreter computes bf16 wrongly, so bf16 is checked here only. Tolerances: normwise relative
error, fp32 1e-5, fp16 2e-3, bf16 1.6e-2 (two bf16 roundings; a wrong formula gives O(1)).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
DTYPES = list(TOL)


def _run(fn, inputs, backend):
    from meshkit.kernels import kernel_backend

    leaves = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
    with kernel_backend(backend):
        out = fn(*leaves)
        outs = list(out) if isinstance(out, tuple) else [out]
        g = torch.Generator(device="cuda").manual_seed(0)
        loss = sum((o.float() * torch.randn(o.shape, device="cuda", generator=g)).sum() for o in outs)
        grads = torch.autograd.grad(loss, [x for x in leaves if x.requires_grad])
    return [o.detach().float() for o in outs] + [x.float() for x in grads]


def _check(fn, inputs, dtype):
    tri, ref = _run(fn, inputs, "triton"), _run(fn, inputs, "reference")
    for i, (a, b) in enumerate(zip(tri, ref)):
        err = ((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item()
        assert err <= TOL[dtype], f"output/grad {i}: {err:.3g} > {TOL[dtype]}"


def _r(*shape, dtype, scale=1.0):
    return (torch.randn(*shape, device="cuda") * scale).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(37, 3000), (4096, 4096), (5, 123)])
def test_rms_norm_and_add_rms_norm(dtype, shape):
    from meshkit.kernels import add_rms_norm, rms_norm

    x, r, w = _r(*shape, dtype=dtype), _r(*shape, dtype=dtype), 1 + _r(shape[-1], dtype=dtype, scale=0.1)
    _check(lambda x, w: rms_norm(x, w, 1e-6), [x, w], dtype)
    _check(lambda x, r, w: add_rms_norm(x, r, w, 1e-6), [x, r, w], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu(dtype):
    from meshkit.kernels import swiglu

    _check(swiglu, [_r(37, 14336, dtype=dtype), _r(37, 14336, dtype=dtype)], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [False, True])
def test_rope(dtype, interleaved):
    from meshkit.kernels import rope

    pos = torch.randint(0, 8192, (2, 37), device="cuda")
    _check(lambda q, k: rope(q, k, pos, theta=500000.0, interleaved=interleaved),
           [_r(2, 37, 32, 128, dtype=dtype), _r(2, 37, 8, 128, dtype=dtype)], dtype)  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES)
def test_flce_vs_cross_entropy(dtype):
    from meshkit.kernels import fused_linear_cross_entropy

    n, h, v = 1024, 512, 32000
    hidden, weight = _r(n, h, dtype=dtype), _r(v, h, dtype=dtype, scale=1 / math.sqrt(h))
    target = torch.randint(0, v, (n,), device="cuda")
    target[::7] = -100
    _check(lambda x, w: fused_linear_cross_entropy(x, w, target), [hidden, weight], dtype)
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    x = hidden.clone().requires_grad_()
    fused_linear_cross_entropy(x, weight.clone().requires_grad_(), target).backward()
    assert torch.cuda.max_memory_allocated() - base < n * v * 4  # never the fp32 logits
    ref = F.cross_entropy((hidden.float() @ weight.float().t()), target)
    with torch.no_grad():
        got = fused_linear_cross_entropy(hidden, weight, target)
    assert abs(got.item() - ref.item()) <= TOL[dtype] * abs(ref.item())
