"""fused_linear_cross_entropy: Triton (interpreter) == torch reference == F.cross_entropy of the logits."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from meshkit.kernels import fused_linear_cross_entropy, kernel_backend

from ._helpers import DTYPES, TOL, TOL_FORMULA, assert_close, f32, forward_backward, triton_and_reference


def _problem(n, h, v, dtype, seed=0, ignore=(3,)):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g).to(dtype)
    weight = (torch.randn(v, h, generator=g) / math.sqrt(h)).to(dtype)
    target = torch.randint(0, v, (n,), generator=g)
    target[list(i for i in ignore if i < n)] = -100
    return hidden, weight, target


@pytest.mark.parametrize(
    "dtype,reduction,n,h,v,chunk",
    [(dt, red, 37, 24, 301, 8) for dt in DTYPES for red in ("mean", "sum")]
    + [(dt, "mean", 5, 16, 123, None) for dt in DTYPES]
    + [(torch.float32, "sum", 16, 32, 64, 4)],
)
def test_flce_matches_cross_entropy(dtype, reduction, n, h, v, chunk):
    hidden, weight, target = _problem(n, h, v, dtype)
    fn = lambda x, w: fused_linear_cross_entropy(x, w, target, reduction=reduction, chunk_size=chunk)  # noqa: E731
    tri, ref = triton_and_reference(fn, [hidden, weight])
    assert tri[0].dtype == torch.float32 and tri[0].shape == ()
    assert_close(tri, ref, TOL[dtype], "triton vs reference")
    ce = lambda x, w: F.cross_entropy(x.float() @ w.float().t(), target, reduction=reduction)  # noqa: E731
    assert_close(f32(ref), f32(forward_backward(ce, [hidden, weight])), TOL_FORMULA[dtype], "reference vs F.cross_entropy")


def test_flce_by_hand():
    # W = 0: every logit is 0, so loss = log V; softmax = 1/V, dz = (1/V - onehot) / n_valid,
    # dW = dz.T @ h and dh = dz @ W = 0. Row 1 is ignored.
    n, h, v = 3, 2, 4
    hidden = torch.tensor([[1.0, 2.0], [5.0, 5.0], [-1.0, 3.0]], requires_grad=True)
    weight = torch.zeros(v, h, requires_grad=True)
    target = torch.tensor([2, -100, 0])
    with kernel_backend("triton"):
        loss = fused_linear_cross_entropy(hidden, weight, target, chunk_size=2)
        loss.backward()
    torch.testing.assert_close(loss, torch.tensor(math.log(4.0)))
    torch.testing.assert_close(hidden.grad, torch.zeros(n, h))
    expected = torch.zeros(v, h)
    for row, t in ((0, 2), (2, 0)):
        for c in range(v):
            expected[c] += (0.25 - (c == t)) / 2 * hidden.detach()[row]
    torch.testing.assert_close(weight.grad, expected)


def test_flce_accepts_batched_tokens_and_default_chunks():
    hidden, weight, target = _problem(12, 8, 50, torch.float32)
    with kernel_backend("triton"):
        a = fused_linear_cross_entropy(hidden.view(3, 4, 8), weight, target.view(3, 4))
    torch.testing.assert_close(a, F.cross_entropy(hidden @ weight.t(), target), rtol=1e-5, atol=1e-6)


def test_flce_all_ignored_is_nan_like_cross_entropy():
    hidden, weight, _ = _problem(4, 8, 10, torch.float32)
    target = torch.full((4,), -100)
    with kernel_backend("reference"):
        assert torch.isnan(fused_linear_cross_entropy(hidden, weight, target))
    assert torch.isnan(F.cross_entropy(hidden @ weight.t(), target))


def test_flce_without_grad_gives_the_same_loss():
    hidden, weight, target = _problem(37, 24, 301, torch.float32)
    with kernel_backend("triton"), torch.no_grad():
        loss = fused_linear_cross_entropy(hidden, weight, target, chunk_size=8)
    torch.testing.assert_close(loss, F.cross_entropy(hidden @ weight.t(), target), rtol=1e-6, atol=1e-6)


def test_flce_backward_twice_raises():
    hidden, weight, target = _problem(4, 8, 10, torch.float32)
    hidden.requires_grad_()
    with kernel_backend("reference"):
        loss = fused_linear_cross_entropy(hidden, weight, target)
        loss.backward(retain_graph=True)
        with pytest.raises(RuntimeError, match="backward ran twice through one graph"):
            loss.backward()


def test_flce_scales_by_upstream_gradient():
    hidden, weight, target = _problem(6, 8, 10, torch.float32)
    h1, h2 = hidden.clone().requires_grad_(), hidden.clone().requires_grad_()
    with kernel_backend("reference"):
        (3.0 * fused_linear_cross_entropy(h1, weight, target)).backward()
    (3.0 * F.cross_entropy(h2 @ weight.t(), target)).backward()
    torch.testing.assert_close(h1.grad, h2.grad, rtol=1e-5, atol=1e-7)


def test_flce_bad_inputs():
    hidden, weight, target = _problem(4, 8, 10, torch.float32)
    fn = fused_linear_cross_entropy
    with pytest.raises(ValueError, match=r"`weight.shape=\(10, 7\)` must be \(vocab, 8\)"):
        fn(hidden, weight[:, :7], target)
    with pytest.raises(ValueError, match=r"`hidden.dtype=torch.float32` and `weight.dtype=torch.float16` must match"):
        fn(hidden, weight.half(), target)
    with pytest.raises(ValueError, match=r"`target.shape=\(3,\)` must equal `hidden.shape\[:-1\]=\(4,\)`"):
        fn(hidden, weight, target[:3])
    with pytest.raises(ValueError, match=r"`target` holds 1 values outside \[0, 10\)"):
        fn(hidden, weight, torch.tensor([0, 1, 10, -100]))
    with pytest.raises(ValueError, match=r"`reduction='none'` must be 'mean' or 'sum'"):
        fn(hidden, weight, target, reduction="none")
    with pytest.raises(ValueError, match=r"`chunk_size=0` must be >= 1"):
        fn(hidden, weight, target, chunk_size=0)
    with pytest.raises(ValueError, match=r"`target` must be an integer tensor"):
        fn(hidden, weight, target.float())
