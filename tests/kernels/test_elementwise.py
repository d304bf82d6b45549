"""RMSNorm, add+RMSNorm, SwiGLU and RoPE: Triton (interpreter) == torch reference == independent formulas."""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F

from meshkit.kernels import add_rms_norm, kernel_backend, rms_norm, rope, swiglu
from meshkit.kernels import apply_rope, rope_cos_sin

from ._helpers import DTYPES, TOL, TOL_FORMULA, assert_close, f32, forward_backward, triton_and_reference

# Odd rows (5, 37) and widths (123, 3000) beside a round shape; the interpreter costs ~1 ms a program.
SHAPES = [(5, 3000), (37, 123)]


def _inputs(shape, dtype, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g).to(dtype) for _ in range(n)]


def _rms_formula(x, w, eps):  # plain autograd in fp32, written from the definition
    xf = x.float()
    return xf / torch.sqrt((xf * xf).mean(-1, keepdim=True) + eps) * w.float()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_rms_norm(dtype, shape):
    _check_rms_norm(dtype, shape)


def _check_rms_norm(dtype, shape):
    """Triton (interpreter) == the torch reference == the formula, forward and backward."""
    x, = _inputs(shape, dtype, 1)
    w = 1 + 0.1 * _inputs(shape[-1:], dtype, 1, seed=7)[0]
    fn = lambda x, w: rms_norm(x, w, 1e-5)  # noqa: E731
    tri, ref = triton_and_reference(fn, [x, w])
    assert_close(tri, ref, TOL[dtype], "triton vs reference")
    formula = forward_backward(lambda x, w: _rms_formula(x, w, 1e-5), [x, w])
    assert_close(f32(ref), f32(formula), TOL_FORMULA[dtype], "reference vs formula")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(5, 3000), (4, 64)])
def test_add_rms_norm(dtype, shape):
    x, r = _inputs(shape, dtype, 2)
    w = 1 + 0.1 * _inputs(shape[-1:], dtype, 1, seed=7)[0]
    fn = lambda x, r, w: add_rms_norm(x, r, w, 1e-6)  # noqa: E731
    tri, ref = triton_and_reference(fn, [x, r, w])
    assert_close(tri, ref, TOL[dtype], "triton vs reference")
    with kernel_backend("reference"):
        unfused = forward_backward(lambda x, r, w: (rms_norm(x + r, w, 1e-6), x + r), [x, r, w])
    assert_close(ref, unfused, TOL[dtype], "fused vs unfused")


class _LaunchSpy:
    """Stands in for a ``@triton.jit`` kernel: records each launch's grid, then launches the kernel."""

    def __init__(self, kernel):
        self.kernel, self.grids = kernel, []

    def __getitem__(self, grid):
        self.grids.append(grid)
        return self.kernel[grid]


# Rows wider than one backward program holds (rms_norm._ROW_BLOCK_MAX = 4096): the column-split backward, in
# 1024-column tiles; 8200 ends in a partial tile of 8 columns.
WIDE_SHAPES = [(3, 8200), (2, 16384)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", WIDE_SHAPES)
def test_rms_norm_wide_rows_take_the_column_split_backward(dtype, shape, monkeypatch):
    rn = importlib.import_module("meshkit.kernels.rms_norm")  # the module (meshkit.kernels.rms_norm: the function)

    spies = {name: _LaunchSpy(getattr(rn, name)) for name in
             ("_rms_norm_bwd_kernel", "_rms_norm_bwd_dot_kernel", "_rms_norm_bwd_cols_kernel")}
    for name, spy in spies.items():
        monkeypatch.setattr(rn, name, spy)
    _check_rms_norm(dtype, shape)
    rows, n = shape
    tiles = -(-n // rn._COL_BLOCK)
    assert spies["_rms_norm_bwd_kernel"].grids == []
    assert spies["_rms_norm_bwd_dot_kernel"].grids == [(rows,)]
    (grid,) = spies["_rms_norm_bwd_cols_kernel"].grids
    assert grid[1] == tiles and grid[0] * tiles >= 4 > (grid[0] - 1) * tiles  # about num_programs (4 on CPU)


def test_add_rms_norm_wide_rows_column_split_with_the_residual_gradient():
    x, r = _inputs(WIDE_SHAPES[0], torch.float32, 2)
    w = 1 + 0.1 * _inputs(WIDE_SHAPES[0][-1:], torch.float32, 1, seed=7)[0]
    fn = lambda x, r, w: add_rms_norm(x, r, w, 1e-6)  # noqa: E731
    tri, ref = triton_and_reference(fn, [x, r, w])
    assert_close(tri, ref, TOL[torch.float32], "triton vs reference")


def test_rms_norm_backward_launch_by_hidden():
    """Whole rows up to 4096 columns; above, the same two column-tiled launches whatever the hidden, so their
    registers do not grow with it (tests/kernels/test_patching.py compiles that launch and holds the bar)."""
    rn = importlib.import_module("meshkit.kernels.rms_norm")  # the module (meshkit.kernels.rms_norm: the function)

    for n in (64, 123, 3000, 4096):
        assert rn._bwd_launch(n) == {"rows": rn._launch(n)}, n
    wide = rn._bwd_launch(4097)
    assert set(wide) == {"dot", "cols"} and wide["cols"] == {"BLOCK_N": 1024, "num_warps": 4}
    for n in (8192, 8200, 16384, 65536, 131072):
        assert rn._bwd_launch(n) == wide, n


def test_rms_norm_by_hand():
    # Rows of 3.0: rstd = 1/3, xhat = 1, so y = w; with dy = 1, dw = rows and
    # dx = rstd * (w - xhat * mean(w * xhat)) = (w - mean(w)) / 3.
    w = torch.tensor([1.0, 2.0, 3.0, 6.0], requires_grad=True)
    x = torch.full((3, 4), 3.0, requires_grad=True)
    with kernel_backend("triton"):
        y = rms_norm(x, w, 1e-12)
        y.sum().backward()
    torch.testing.assert_close(y, w.detach().expand(3, 4))
    torch.testing.assert_close(w.grad, torch.full((4,), 3.0))
    torch.testing.assert_close(x.grad, ((w - 3.0) / 3).detach().expand(3, 4))


def test_rms_norm_keeps_leading_dims_and_promotes_like_the_model():
    x = torch.randn(2, 3, 8, dtype=torch.float16)
    w = torch.ones(8, dtype=torch.float32)
    with kernel_backend("triton"):
        y = rms_norm(x, w, 1e-5)
    assert y.shape == (2, 3, 8) and y.dtype == torch.float32  # as HF: weight * x.to(input_dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(37, 123), (4, 3000)])
def test_swiglu(dtype, shape):
    g, u = _inputs(shape, dtype, 2)
    tri, ref = triton_and_reference(swiglu, [g, u])
    assert_close(tri, ref, TOL[dtype], "triton vs reference")
    formula = forward_backward(lambda g, u: g.float() * torch.sigmoid(g.float()) * u.float(), [g, u])
    assert_close(f32(ref), f32(formula), TOL_FORMULA[dtype], "reference vs formula")


def _complex_rope(x, positions, theta):  # Meta's formulation: pairs (2i, 2i+1) as complex numbers
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2).float() / d)
    ang = positions.float()[..., None] * inv
    rot = torch.polar(torch.ones_like(ang), ang)
    rot = rot[None, :, None, :] if rot.dim() == 2 else rot[:, :, None, :]
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], d // 2, 2).contiguous())
    return torch.view_as_real(xc * rot).flatten(-2)


@pytest.mark.parametrize(
    "dtype,interleaved,shape,batch_positions",
    [
        (torch.float32, False, (2, 4, 4, 16), True),
        (torch.float32, True, (1, 5, 3, 10), False),
        (torch.float16, False, (1, 5, 3, 10), False),
        (torch.float16, True, (2, 4, 4, 16), True),
    ],
)
def test_rope(dtype, interleaved, shape, batch_positions):
    B, T, H, D = shape
    q, = _inputs(shape, dtype, 1)
    k, = _inputs((B, T, max(1, H - 1), D), dtype, 1, seed=1)
    g = torch.Generator().manual_seed(2)
    positions = torch.randint(0, 4096, (B, T) if batch_positions else (T,), generator=g)
    fn = lambda q, k: rope(q, k, positions, theta=500000.0, interleaved=interleaved)  # noqa: E731
    tri, ref = triton_and_reference(fn, [q, k])
    assert_close(tri, ref, TOL[dtype], "triton vs reference")
    if interleaved:
        indep = lambda q, k: (_complex_rope(q, positions, 500000.0), _complex_rope(k, positions, 500000.0))  # noqa: E731
    else:
        cos, sin = rope_cos_sin(positions, D, 500000.0)
        indep = lambda q, k: (apply_rope(q.float(), cos, sin), apply_rope(k.float(), cos, sin))  # noqa: E731
    # fp16 inputs: the formula in fp32 differs from the kernel by one output rounding.
    assert_close(f32(ref), f32(forward_backward(indep, [q, k])), TOL_FORMULA[dtype], "reference vs formula")


def test_rope_by_hand():
    # head_dim 2, theta irrelevant for the first pair (frequency 1): position p rotates (1, 0) to (cos p, sin p).
    q = torch.tensor([1.0, 0.0]).reshape(1, 1, 1, 2).repeat(1, 3, 1, 1)
    with kernel_backend("triton"):
        q2, _ = rope(q, q, torch.tensor([0, 1, 2]))
    p = torch.tensor([0.0, 1.0, 2.0])
    torch.testing.assert_close(q2[0, :, 0], torch.stack([p.cos(), p.sin()], -1))


def test_rope_transposed_input_matches_contiguous():
    q = torch.randn(2, 3, 6, 8).transpose(1, 2)  # (B, T, H, D) view of (B, H, T, D) memory: HF's layout
    pos = torch.arange(6)
    with kernel_backend("triton"):
        a, _ = rope(q, q, pos)
        b, _ = rope(q.contiguous(), q.contiguous(), pos)
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_bad_inputs_raise_clear_errors():
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match=r"`weight.shape=\(7,\)` must be \(8,\)"):
        rms_norm(x, torch.ones(7))
    with pytest.raises(ValueError, match=r"`x.dtype=torch.int64` is not supported"):
        rms_norm(torch.ones(4, 8, dtype=torch.long), torch.ones(8))
    with pytest.raises(ValueError, match=r"`eps=0` must be > 0"):
        rms_norm(x, torch.ones(8), 0)
    with pytest.raises(ValueError, match=r"`x.shape=torch.Size\(\[4, 8\]\)`, `residual.shape=torch.Size\(\[4, 7\]\)`"):
        add_rms_norm(x, torch.randn(4, 7), torch.ones(8))
    with pytest.raises(ValueError, match=r"`gate.dtype=torch.float32`, `up.dtype=torch.float16` must be equal"):
        swiglu(x, x.half())
    with pytest.raises(ValueError, match=r"swiglu: `gate.dtype=torch.float64` is not supported"):
        swiglu(x.double(), x.double())
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(ValueError, match=r"`positions.shape=\(5,\)` must be \(4,\) or \(1, 4\)"):
        rope(q, q, torch.arange(5))
    with pytest.raises(ValueError, match=r"even head_dim"):
        rope(torch.randn(1, 4, 2, 7), torch.randn(1, 4, 2, 7), torch.arange(4))
    with pytest.raises(ValueError, match=r"`positions.dtype=torch.float32` must be an integer dtype"):
        rope(q, q, torch.arange(4.0))
    with pytest.raises(ValueError, match=r"`MESHKIT_KERNELS='fast'` is not one of"):
        import os

        os.environ["MESHKIT_KERNELS"] = "fast"
        try:
            swiglu(x, x)
        finally:
            del os.environ["MESHKIT_KERNELS"]
    with pytest.raises(ValueError, match=r"kernel_backend: `name='gpu'`"):
        with kernel_backend("gpu"):
            pass
