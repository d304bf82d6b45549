"""RMSNorm and fused residual-add + RMSNorm: Triton kernels, torch reference, custom ops, autograd.

``y = x / sqrt(mean(x**2, -1) + eps) * weight``, computed in fp32 and stored in
``promote_types(x.dtype, weight.dtype)`` (what HF's LlamaRMSNorm and meshkit's demo RMSNorm return).
Backward: with ``xhat = x * rstd`` and ``g = dy * weight``,
``dx = rstd * (g - xhat * mean(g * xhat))`` and ``dweight = sum_rows(dy * xhat)`` (fp32 per program,
summed in torch). Rows up to 4096 wide: one program holds whole rows; wider rows: ``mean(g * xhat)`` per row
first, then dx and dweight in column tiles, so registers do not grow with the hidden size (``_bwd_launch``).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from ._backend import (
    HAS_TRITON,
    all_reduce_grad,
    block_size,
    check_float,
    check_same,
    is_dtensor,
    num_programs,
    warps,
    tl,
    triton,
    use_triton,
)

__all__ = ["rms_norm", "add_rms_norm"]

if HAS_TRITON:

    @triton.jit
    def _rms_norm_fwd_kernel(
        X, RES, W, Y, RES_OUT, RSTD,
        stride_x, stride_res, stride_y, stride_res_out,
        N, eps,
        HAS_RES: tl.constexpr, BLOCK_N: tl.constexpr,
    ):  # fmt: skip
        # One program per row: (rows, N) -> y (rows, N), rstd (rows,).
        row = tl.cast(tl.program_id(0), tl.int64)
        cols = tl.arange(0, BLOCK_N)
        mask = cols < N
        x = tl.cast(tl.load(X + row * stride_x + cols, mask=mask, other=0.0), tl.float32)
        if HAS_RES:
            r = tl.cast(tl.load(RES + row * stride_res + cols, mask=mask, other=0.0), tl.float32)
            # Round the sum to the storage dtype first, as the unfused `x + residual` does.
            s = tl.cast(x + r, RES_OUT.dtype.element_ty)
            tl.store(RES_OUT + row * stride_res_out + cols, s, mask=mask)
            x = tl.cast(s, tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / tl.cast(N, tl.float32) + eps)
        w = tl.cast(tl.load(W + cols, mask=mask, other=0.0), tl.float32)
        tl.store(Y + row * stride_y + cols, tl.cast(x * rstd * w, Y.dtype.element_ty), mask=mask)
        tl.store(RSTD + row, rstd)

    @triton.jit
    def _rms_norm_bwd_kernel(
        DY, X, W, RSTD, DRES, DX, DW_PART,
        stride_dy, stride_x, stride_dres, stride_dx,
        n_rows, N, rows_per_program,
        HAS_DRES: tl.constexpr, BLOCK_N: tl.constexpr,
    ):  # fmt: skip
        # Each program walks `rows_per_program` consecutive rows and writes its fp32 dweight partial sum.
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK_N)
        mask = cols < N
        w = tl.cast(tl.load(W + cols, mask=mask, other=0.0), tl.float32)
        dw = tl.zeros([BLOCK_N], dtype=tl.float32)
        # The loop stops at the last row instead of masking rows past it: a block mask `&`-ed with a scalar
        # `row < n_rows` reaches tl.load as an int32 mask under the interpreter, which triton 3.9 rejects
        # ("mask has unsupported dtype"); every load below is masked by `cols < N` alone.
        first = tl.cast(pid, tl.int64) * rows_per_program
        last = tl.minimum(first + rows_per_program, n_rows)
        for row in range(first, last):
            dy = tl.cast(tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0), tl.float32)
            x = tl.cast(tl.load(X + row * stride_x + cols, mask=mask, other=0.0), tl.float32)
            rstd = tl.load(RSTD + row)
            xhat = x * rstd
            g = dy * w
            dx = rstd * (g - xhat * (tl.sum(g * xhat, axis=0) / tl.cast(N, tl.float32)))
            if HAS_DRES:
                dx += tl.cast(tl.load(DRES + row * stride_dres + cols, mask=mask, other=0.0), tl.float32)
            tl.store(DX + row * stride_dx + cols, tl.cast(dx, DX.dtype.element_ty), mask=mask)
            dw += dy * xhat
        tl.store(DW_PART + tl.cast(pid, tl.int64) * N + cols, dw, mask=mask)

    # Rows wider than one block (hidden > _ROW_BLOCK_MAX): the backward in column tiles, so no program holds a
    # whole row. First the one per-row reduction, then dx and dweight tile by tile.

    @triton.jit
    def _rms_norm_bwd_dot_kernel(
        DY, X, W, RSTD, DOT,
        stride_dy, stride_x,
        N,
        BLOCK_N: tl.constexpr,
    ):  # fmt: skip
        # One program per row: DOT[row] = mean(g * xhat) over the row, g = dy * w, in BLOCK_N-wide column tiles.
        row = tl.cast(tl.program_id(0), tl.int64)
        rstd = tl.load(RSTD + row)
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for start in range(0, N, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            mask = cols < N
            dy = tl.cast(tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0), tl.float32)
            x = tl.cast(tl.load(X + row * stride_x + cols, mask=mask, other=0.0), tl.float32)
            w = tl.cast(tl.load(W + cols, mask=mask, other=0.0), tl.float32)
            acc += (dy * w) * (x * rstd)
        tl.store(DOT + row, tl.sum(acc, axis=0) / tl.cast(N, tl.float32))

    @triton.jit
    def _rms_norm_bwd_cols_kernel(
        DY, X, W, RSTD, DOT, DRES, DX, DW_PART,
        stride_dy, stride_x, stride_dres, stride_dx,
        n_rows, N, rows_per_program,
        HAS_DRES: tl.constexpr, BLOCK_N: tl.constexpr,
    ):  # fmt: skip
        # Program (p, t): column tile t of rows [p * rows_per_program, ...): dx there, and its fp32 dweight partial
        # DW_PART[p, tile]. The rows' mean(g * xhat) comes from _rms_norm_bwd_dot_kernel.
        pid = tl.program_id(0)
        cols = tl.cast(tl.program_id(1), tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = cols < N
        w = tl.cast(tl.load(W + cols, mask=mask, other=0.0), tl.float32)
        dw = tl.zeros([BLOCK_N], dtype=tl.float32)
        first = tl.cast(pid, tl.int64) * rows_per_program
        last = tl.minimum(first + rows_per_program, n_rows)
        for row in range(first, last):  # a bounded loop, not a row mask (see _rms_norm_bwd_kernel)
            dy = tl.cast(tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0), tl.float32)
            x = tl.cast(tl.load(X + row * stride_x + cols, mask=mask, other=0.0), tl.float32)
            rstd = tl.load(RSTD + row)
            xhat = x * rstd
            dx = rstd * (dy * w - xhat * tl.load(DOT + row))
            if HAS_DRES:
                dx += tl.cast(tl.load(DRES + row * stride_dres + cols, mask=mask, other=0.0), tl.float32)
            tl.store(DX + row * stride_dx + cols, tl.cast(dx, DX.dtype.element_ty), mask=mask)
            dw += dy * xhat
        tl.store(DW_PART + tl.cast(pid, tl.int64) * N + cols, dw, mask=mask)


# --------------------------------------------------------------------------------------------- launchers


_ROW_BLOCK_MAX = 4096
"""The widest row one backward program holds whole (``_rms_norm_bwd_kernel``). At 8192, 16 warps (128 registers a
thread at most) spill 72 / 168 B on sm_80 / sm_90 (16384: 848 / 792 B); wider rows take the column-split path."""
_COL_BLOCK = 1024
"""The column tile of the column-split backward, whatever the hidden (4 warps, ``warps(1024)``): dx/dweight 80 / 76
registers, 0 spills, 38 % on sm_80 / sm_90 (a 2048 tile at 8 warps: 25 % on sm_90)."""


def _launch(n: int) -> dict[str, int]:
    """The block and warps both row kernels launch with for rows of ``n`` (also what the occupancy report measures)."""
    block = block_size(n)
    return {"BLOCK_N": block, "num_warps": warps(block)}


def _bwd_launch(n: int) -> dict[str, dict[str, int]]:
    """The backward's kernels for rows of ``n`` and the launch of each: ``{"rows": ...}`` (one program holds a whole
    row) up to :data:`_ROW_BLOCK_MAX`, else ``{"dot": ..., "cols": ...}`` in :data:`_COL_BLOCK` tiles, the same
    launch for every wider hidden. Used by the launcher and by ``builtin_kernel_specs`` (the report measures it)."""
    if block_size(n) <= _ROW_BLOCK_MAX:
        return {"rows": _launch(n)}
    tile = {"BLOCK_N": _COL_BLOCK, "num_warps": warps(_COL_BLOCK)}
    return {"dot": tile, "cols": tile}


def _fwd_triton(x2, res2, weight, eps, out_dtype):
    rows, n = x2.shape
    y = torch.empty((rows, n), dtype=out_dtype, device=x2.device)
    res_out = torch.empty_like(x2) if res2 is not None else x2.new_empty(0)
    rstd = torch.empty(rows, dtype=torch.float32, device=x2.device)
    if rows:
        res_arg = res2 if res2 is not None else x2
        out_arg = res_out if res2 is not None else x2
        _rms_norm_fwd_kernel[(rows,)](
            x2, res_arg, weight, y, out_arg, rstd,
            x2.stride(0), res_arg.stride(0), y.stride(0), out_arg.stride(0),
            n, eps, HAS_RES=res2 is not None, **_launch(n),
        )  # fmt: skip
    return y, res_out, rstd


def _bwd_triton(dy2, x2, weight, rstd, dres2):
    rows, n = x2.shape
    dx = torch.empty_like(x2)
    launch = _bwd_launch(n)
    tiles = 1 if "rows" in launch else -(-n // launch["cols"]["BLOCK_N"])
    progs = max(1, -(-num_programs(x2, rows) // tiles))  # row groups: about num_programs programs in all
    per = -(-rows // progs) if rows else 0
    dw_part = torch.zeros((progs, n), dtype=torch.float32, device=x2.device)
    if rows:
        dres_arg = dres2 if dres2 is not None else dy2
        if "rows" in launch:
            _rms_norm_bwd_kernel[(progs,)](
                dy2, x2, weight, rstd, dres_arg, dx, dw_part,
                dy2.stride(0), x2.stride(0), dres_arg.stride(0), dx.stride(0),
                rows, n, per, HAS_DRES=dres2 is not None, **launch["rows"],
            )  # fmt: skip
        else:
            dot = torch.empty(rows, dtype=torch.float32, device=x2.device)  # mean(g * xhat) per row
            _rms_norm_bwd_dot_kernel[(rows,)](
                dy2, x2, weight, rstd, dot, dy2.stride(0), x2.stride(0), n, **launch["dot"],
            )  # fmt: skip
            _rms_norm_bwd_cols_kernel[(progs, tiles)](
                dy2, x2, weight, rstd, dot, dres_arg, dx, dw_part,
                dy2.stride(0), x2.stride(0), dres_arg.stride(0), dx.stride(0),
                rows, n, per, HAS_DRES=dres2 is not None, **launch["cols"],
            )  # fmt: skip
    return dx, dw_part.sum(0).to(weight.dtype)


def _fwd_reference(x2, res2, weight, eps, out_dtype):
    if res2 is not None:
        res_out = x2 + res2
        xf = res_out.float()
    else:
        res_out, xf = x2.new_empty(0), x2.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1) + eps)
    y = (xf * rstd[:, None] * weight.float()).to(out_dtype)
    return y, res_out, rstd


def _bwd_reference(dy2, x2, weight, rstd, dres2):
    xhat = x2.float() * rstd[:, None]
    g = dy2.float() * weight.float()
    dx = rstd[:, None] * (g - xhat * (g * xhat).mean(-1, keepdim=True))
    if dres2 is not None:
        dx = dx + dres2.float()
    return dx.to(x2.dtype), (dy2.float() * xhat).sum(0).to(weight.dtype)


# ------------------------------------------------------------------------------------- custom ops, autograd


@torch.library.custom_op("meshkit::rms_norm_fwd", mutates_args=())
def _rms_norm_fwd(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x (rows, N), residual or None, weight (N,)) -> (y, x + residual or empty, rstd fp32 (rows,))."""
    out_dtype = torch.promote_types(x.dtype, weight.dtype)
    x, weight = x.contiguous(), weight.contiguous()
    residual = residual.contiguous() if residual is not None else None
    fwd = _fwd_triton if use_triton(x) else _fwd_reference
    return fwd(x, residual, weight, eps, out_dtype)


@_rms_norm_fwd.register_fake
def _(x, residual, weight, eps):
    out_dtype = torch.promote_types(x.dtype, weight.dtype)
    res_out = torch.empty_like(x) if residual is not None else x.new_empty(0)
    return x.new_empty(x.shape, dtype=out_dtype), res_out, x.new_empty(x.shape[0], dtype=torch.float32)


@torch.library.custom_op("meshkit::rms_norm_bwd", mutates_args=())
def _rms_norm_bwd(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, dres: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of :func:`_rms_norm_fwd` w.r.t. the normalized input and weight (+ ``dres`` into dx)."""
    dy, x, weight = dy.contiguous(), x.contiguous(), weight.contiguous()
    dres = dres.contiguous() if dres is not None else None
    bwd = _bwd_triton if use_triton(x) else _bwd_reference
    return bwd(dy, x, weight, rstd, dres)


@_rms_norm_bwd.register_fake
def _(dy, x, weight, rstd, dres):
    return torch.empty_like(x), torch.empty_like(weight)


def _setup_context(ctx, inputs, output):
    x, residual, weight, _ = inputs
    _, res_out, rstd = output
    ctx.has_res = residual is not None
    ctx.set_materialize_grads(False)  # no zero tensors for unused outputs (rstd, an unused residual)
    ctx.save_for_backward(res_out if ctx.has_res else x, weight, rstd)


def _backward(ctx, dy, dres_out, _drstd):
    normed_input, weight, rstd = ctx.saved_tensors
    if dy is None:
        dy = torch.zeros(normed_input.shape, dtype=torch.promote_types(normed_input.dtype, weight.dtype),
                         device=normed_input.device)  # fmt: skip
    dres = dres_out if (ctx.has_res and dres_out is not None and dres_out.numel()) else None
    dx, dw = _rms_norm_bwd(dy, normed_input, weight, rstd, dres)
    return dx, (dx if ctx.has_res else None), dw, None


_rms_norm_fwd.register_autograd(_backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------------------------- public


def _check(fn: str, x, residual, weight, eps) -> None:
    check_float("x", x, fn)
    check_float("weight", weight, fn)
    if weight.dim() != 1 or x.dim() == 0 or weight.shape[0] != x.shape[-1]:
        raise ValueError(
            f"{fn}: `weight.shape={tuple(weight.shape)}` must be ({x.shape[-1] if x.dim() else '?'},), the last "
            f"dim of `x.shape={tuple(x.shape)}`; RMSNorm normalizes the last dim."
        )
    if residual is not None:
        check_float("residual", residual, fn)
        check_same(fn, ("x", "residual"), (x, residual), "shape")
        check_same(fn, ("x", "residual"), (x, residual), "dtype")
    if not eps > 0:
        raise ValueError(f"{fn}: `eps={eps}` must be > 0.")


def _local_call(x, residual, weight, eps):
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    r2 = residual.reshape(-1, shape[-1]) if residual is not None else None
    y, res_out, _ = _rms_norm_fwd(x2, r2, weight, float(eps))
    return y.view(shape), (res_out.view(shape) if residual is not None else None)


def _dtensor_call(fn: str, x, residual, weight, eps):
    """Local kernels on DTensor shards; dweight is summed over the mesh axes that shard the rows of ``x``."""
    if not is_dtensor(x):
        raise ValueError(f"{fn}: `weight` is a DTensor but `x` is not; pass `x` as a DTensor on the same mesh.")
    mesh, placements = x.device_mesh, x.placements
    for p in placements:
        if not (isinstance(p, (Shard, Replicate))) or (isinstance(p, Shard) and p.dim % x.dim() == x.dim() - 1):
            raise ValueError(
                f"{fn}: `x.placements={placements}` must shard only leading dims (or replicate); the normalized "
                "last dim cannot be sharded and Partial inputs must be reduced first (x.redistribute(...))."
            )
    if residual is not None and (not is_dtensor(residual) or residual.placements != placements):
        raise ValueError(f"{fn}: `residual` must be a DTensor with `x.placements={placements}`.")
    if is_dtensor(weight):
        if weight.device_mesh != mesh or any(not isinstance(p, Replicate) for p in weight.placements):
            raise ValueError(
                f"{fn}: `weight.placements={weight.placements}` must be Replicate on the mesh of `x` "
                "(SequenceParallel's layout for norm weights)."
            )
        w_local = weight.to_local()
    else:
        w_local = weight
    groups = [mesh.get_group(i) for i, p in enumerate(placements) if isinstance(p, Shard)]
    w_local = all_reduce_grad(w_local, groups)
    y, res_out = _local_call(x.to_local(), residual.to_local() if residual is not None else None, w_local, eps)

    def wrap(t):
        return DTensor.from_local(t, mesh, placements, run_check=False, shape=x.shape, stride=x.stride())

    return wrap(y), (wrap(res_out) if residual is not None else None)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm over the last dim: ``x * rsqrt(mean(x**2, -1) + eps) * weight``, with autograd.

    ``x`` (..., N) and ``weight`` (N,) may be DTensors: ``x`` sharded on leading dims (sequence parallel)
    keeps its placements and ``weight``'s gradient is summed over the sharding mesh axes.

    Example::

        >>> import torch
        >>> from meshkit.kernels import rms_norm
        >>> y = rms_norm(torch.full((2, 4), 3.0), torch.ones(4), eps=0.0 + 1e-12)
        >>> torch.allclose(y, torch.ones(2, 4))
        True
    """
    _check("rms_norm", x, None, weight, eps)
    if is_dtensor(x) or is_dtensor(weight):
        return _dtensor_call("rms_norm", x, None, weight, eps)[0]
    return _local_call(x, None, weight, eps)[0]


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused ``new_residual = x + residual; (rms_norm(new_residual, weight, eps), new_residual)``.

    Example::

        >>> import torch
        >>> from meshkit.kernels import add_rms_norm
        >>> y, h = add_rms_norm(torch.ones(2, 4), torch.ones(2, 4), torch.ones(4))
        >>> h[0, 0].item(), round(y[0, 0].item(), 4)
        (2.0, 1.0)
    """
    _check("add_rms_norm", x, residual, weight, eps)
    if is_dtensor(x) or is_dtensor(weight) or is_dtensor(residual):
        return _dtensor_call("add_rms_norm", x, residual, weight, eps)
    return _local_call(x, residual, weight, eps)
