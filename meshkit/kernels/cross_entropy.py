"""Fused linear + cross-entropy, chunked over tokens and vocab-parallel: the logits never exist whole.

For a chunk of tokens ``h`` (c, H) and the (local) vocabulary rows ``W`` (V_loc, H):
``z = h @ W.T`` (c, V_loc); two Triton row kernels give the local max, sum-exp and target logit of
``z``; under vocab parallelism those three are combined across the TP group (all-reduce of the max,
then of the rescaled sum-exp and the target logit); ``lse = max + log(sumexp)``,
``loss_row = lse - z[target]``. The gradient is formed in the forward, in place of ``z``:
``dz = (softmax(z) - onehot(target)) * scale`` (``scale = 1/n_valid`` for "mean", 1 for "sum", 0 on
ignored rows); ``dh = dz @ W`` (a partial sum across TP ranks, reduced once) and ``dW += dz.T @ h``
accumulated in fp32. Backward only scales the stored gradients by the incoming scalar.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from ._backend import HAS_TRITON, all_reduce_grad, block_size, check_float, is_dtensor, tl, triton, use_triton, warps

__all__ = ["fused_linear_cross_entropy"]

_BLOCK_V = 4096  # vocab columns per inner step of the row kernels

if HAS_TRITON:

    @triton.jit
    def _ce_stats_kernel(Z, TARGET, M, S, ZT, stride_z, V, vocab_start, BLOCK_V: tl.constexpr):
        # One program per row of z (c, V): online max and sum-exp, and z[target] if target is local.
        row = tl.cast(tl.program_id(0), tl.int64)
        target = tl.cast(tl.load(TARGET + row), tl.int64) - vocab_start
        m = tl.cast(float("-inf"), tl.float32)
        s = tl.cast(0.0, tl.float32)
        zt = tl.cast(0.0, tl.float32)
        for off in range(0, V, BLOCK_V):
            cols = off + tl.arange(0, BLOCK_V)
            mask = cols < V
            z = tl.cast(tl.load(Z + row * stride_z + cols, mask=mask, other=float("-inf")), tl.float32)
            m_new = tl.maximum(m, tl.max(z, axis=0))
            s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), axis=0)
            m = m_new
            zt += tl.sum(tl.where((cols == target) & mask, z, 0.0), axis=0)
        tl.store(M + row, m)
        tl.store(S + row, s)
        tl.store(ZT + row, zt)

    @triton.jit
    def _ce_grad_kernel(Z, TARGET, LSE, SCALE, stride_z, V, vocab_start, BLOCK_V: tl.constexpr):
        # In place: z <- (exp(z - lse) - onehot(target)) * scale, one program per row.
        row = tl.cast(tl.program_id(0), tl.int64)
        target = tl.cast(tl.load(TARGET + row), tl.int64) - vocab_start
        lse = tl.load(LSE + row)
        scale = tl.load(SCALE + row)
        for off in range(0, V, BLOCK_V):
            cols = off + tl.arange(0, BLOCK_V)
            mask = cols < V
            z = tl.cast(tl.load(Z + row * stride_z + cols, mask=mask, other=0.0), tl.float32)
            g = (tl.exp(z - lse) - tl.where(cols == target, 1.0, 0.0)) * scale
            tl.store(Z + row * stride_z + cols, tl.cast(g, Z.dtype.element_ty), mask=mask)


def _launch(v: int) -> dict[str, int]:
    """Block and warps of both row kernels over ``v`` vocab columns (also what the occupancy report measures)."""
    block = block_size(v, _BLOCK_V)
    return {"BLOCK_V": block, "num_warps": warps(block)}


def _stats(z, target, vocab_start):
    """Row max, sum-exp relative to it, and the local target logit (0 where the target is elsewhere)."""
    rows, v = z.shape
    if use_triton(z):
        m, s, zt = (torch.empty(rows, dtype=torch.float32, device=z.device) for _ in range(3))
        if rows:
            _ce_stats_kernel[(rows,)](z, target, m, s, zt, z.stride(0), v, vocab_start, **_launch(v))
        return m, s, zt
    zf = z.float()
    m = zf.max(-1).values
    s = torch.exp(torch.logsumexp(zf, -1) - m)
    local = target - vocab_start
    hit = (local >= 0) & (local < v)
    zt = torch.where(hit, zf.gather(1, local.clamp(0, v - 1)[:, None])[:, 0], torch.zeros_like(m))
    return m, s, zt


def _grad_inplace(z, target, lse, scale, vocab_start) -> None:
    rows, v = z.shape
    if use_triton(z):
        if rows:
            _ce_grad_kernel[(rows,)](z, target, lse, scale, z.stride(0), v, vocab_start, **_launch(v))
        return
    g = z if z.dtype == torch.float32 else z.float()  # in place for fp32: no chunk-sized temporaries
    g.sub_(lse[:, None]).exp_()
    local = target - vocab_start
    rows = torch.nonzero((local >= 0) & (local < v))[:, 0]
    g[rows, local[rows]] -= 1.0
    g.mul_(scale[:, None])
    if g is not z:
        z.copy_(g)


def _chunk_rows(n: int, v: int, h: int) -> int:
    # Logits chunk about the size of the hidden states: c * V ~ n * H (Liger's rule of thumb).
    return max(1, min(n, triton.next_power_of_2(-(-n // max(1, -(-v // h)))) if HAS_TRITON else n))


def _flce(h, w, target, ignore_index: int, reduction: str, vocab_start: int, group, chunk: int | None, grads=True):
    """Loss, dh (partial over ``group``), dw (fp32) for h (N, H), local w (V_loc, H), target (N,)."""
    n, v = h.shape[0], w.shape[0]
    valid = target != ignore_index
    n_valid = valid.sum()
    scale_all = valid.float() / n_valid.clamp(min=1) if reduction == "mean" else valid.float()
    dh = torch.empty_like(h) if grads else h.new_empty(0)
    dw = torch.zeros(w.shape if grads else (0,), dtype=torch.float32, device=w.device)
    loss_rows = torch.zeros(n, dtype=torch.float32, device=h.device)
    step = chunk or _chunk_rows(n, v, h.shape[1])
    for a in range(0, n, step):
        b = min(n, a + step)
        hc, tc = h[a:b], target[a:b]
        z = hc @ w.t()  # (c, V_loc), the only logits alive
        m, s, zt = _stats(z, tc, vocab_start)
        if group is not None:
            m_all = m.clone()
            dist.all_reduce(m_all, op=dist.ReduceOp.MAX, group=group)
            st = torch.stack([s * torch.exp(m - m_all), zt])
            dist.all_reduce(st, op=dist.ReduceOp.SUM, group=group)
            m, s, zt = m_all, st[0], st[1]
        lse = m + torch.log(s)
        loss_rows[a:b] = torch.where(valid[a:b], lse - zt, torch.zeros_like(lse))
        if not grads:  # evaluation: the loss alone
            continue
        _grad_inplace(z, tc, lse, scale_all[a:b].contiguous(), vocab_start)
        torch.mm(z, w, out=dh[a:b])
        if z.dtype == torch.float32:
            dw.addmm_(z.t(), hc)  # no (V, H) temporary
        else:
            dw += z.t() @ hc  # tensor-core matmul, fp32 accumulation across chunks
    loss = loss_rows.sum()
    if reduction == "mean":
        loss = loss / n_valid  # 0/0 = nan with no valid token, as F.cross_entropy
    return loss, dh, dw


@torch.library.custom_op("meshkit::fused_linear_cross_entropy", mutates_args=())
def _flce_op(
    h: torch.Tensor, w: torch.Tensor, target: torch.Tensor, ignore_index: int, reduction: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Single-process FLCE: (loss fp32 scalar, dh, dw fp32)."""
    return _flce(h.contiguous(), w.contiguous(), target.contiguous(), ignore_index, reduction, 0, None, None)


@_flce_op.register_fake
def _(h, w, target, ignore_index, reduction):
    return h.new_empty((), dtype=torch.float32), torch.empty_like(h), w.new_empty(w.shape, dtype=torch.float32)


def _stash(ctx, dh, dw, w_dtype) -> None:
    # Kept as attributes, not saved tensors: backward hands them over as the only reference, so
    # AccumulateGrad adopts them instead of cloning a (V, H) fp32 buffer.
    ctx.grads, ctx.w_dtype = (dh, dw), w_dtype


def _take(ctx):
    if ctx.grads is None:
        raise RuntimeError(
            "fused_linear_cross_entropy: backward ran twice through one graph; the gradients are formed in the "
            "forward and handed over once (retain_graph=True is not supported). Run the forward again."
        )
    grads, ctx.grads = ctx.grads, None
    return grads


def _setup_context(ctx, inputs, output):
    _, w, _, _, _ = inputs
    _, dh, dw = output
    ctx.set_materialize_grads(False)  # else autograd allocates zero "gradients" for the dh and dw outputs
    _stash(ctx, dh, dw, w.dtype)


def _scaled(dh, dw, dloss, w_dtype):
    # The usual upstream gradient is 1 (loss.backward()): skip two full-size copies (one sync to check).
    if bool(dloss == 1):
        return dh, dw.to(w_dtype)
    return (dh * dloss).to(dh.dtype), (dw * dloss).to(w_dtype)


def _backward(ctx, dloss, _dh, _dw):
    dh, dw = _take(ctx)
    return (*_scaled(dh, dw, dloss, ctx.w_dtype), None, None, None)


_flce_op.register_autograd(_backward, setup_context=_setup_context)


class _VocabParallelFLCE(torch.autograd.Function):
    """FLCE over a vocab shard; collectives on ``group``; dh returned partial (the caller reduces it)."""

    @staticmethod
    def forward(ctx, h, w, target, ignore_index, reduction, vocab_start, group, chunk):  # type: ignore[override]
        loss, dh, dw = _flce(h, w, target, ignore_index, reduction, vocab_start, group, chunk)
        _stash(ctx, dh, dw, w.dtype)
        return loss

    @staticmethod
    def backward(ctx, dloss):  # type: ignore[override]
        dh, dw = _take(ctx)
        return (*_scaled(dh, dw, dloss, ctx.w_dtype), None, None, None, None, None, None)


def _check(hidden, weight, target, ignore_index, reduction) -> None:
    fn = "fused_linear_cross_entropy"
    check_float("hidden", hidden, fn)
    check_float("weight", weight, fn)
    if hidden.dtype != weight.dtype:
        raise ValueError(f"{fn}: `hidden.dtype={hidden.dtype}` and `weight.dtype={weight.dtype}` must match.")
    if weight.dim() != 2 or hidden.dim() < 1 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"{fn}: `weight.shape={tuple(weight.shape)}` must be (vocab, {hidden.shape[-1] if hidden.dim() else '?'}),"
            f" matching the last dim of `hidden.shape={tuple(hidden.shape)}` (an nn.Linear LM-head weight)."
        )
    if not isinstance(target, torch.Tensor) or target.is_floating_point() or target.is_complex():
        raise ValueError(f"{fn}: `target` must be an integer tensor of class indices.")
    if tuple(target.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(
            f"{fn}: `target.shape={tuple(target.shape)}` must equal `hidden.shape[:-1]={tuple(hidden.shape[:-1])}`."
        )
    if reduction not in ("mean", "sum"):
        raise ValueError(
            f"{fn}: `reduction={reduction!r}` must be 'mean' or 'sum' (per-token losses would need the logits kept)."
        )
    vocab = weight.shape[0]
    t = target.to_local() if is_dtensor(target) else target
    bad = ((t < 0) | (t >= vocab)) & (t != ignore_index)
    if bool(bad.any()):
        raise ValueError(
            f"{fn}: `target` holds {int(bad.sum())} values outside [0, {vocab}) that are not "
            f"`ignore_index={ignore_index}`."
        )


def _loss_only(hidden, weight, target, ignore_index, reduction, chunk_size):
    """No gradient wanted (evaluation): the same chunked loss without forming dh and dW."""
    group, vocab_start = None, 0
    if is_dtensor(weight):
        mesh = weight.device_mesh
        if is_dtensor(hidden):
            hidden = hidden.redistribute(mesh, [Replicate()]).to_local()
        if is_dtensor(target):
            target = target.redistribute(mesh, [Replicate()]).to_local()
        if isinstance(weight.placements[0], Shard):
            group = mesh.get_group(0)
            vocab_start = mesh.get_local_rank() * (-(-weight.shape[0] // mesh.size()))
        weight = weight.to_local()
    h2, t2 = hidden.reshape(-1, hidden.shape[-1]).contiguous(), target.reshape(-1).long().contiguous()
    with torch.no_grad():
        return _flce(h2, weight.contiguous(), t2, ignore_index, reduction, vocab_start, group, chunk_size, grads=False)[0]


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    chunk_size: int | None = None,
) -> torch.Tensor:
    """``F.cross_entropy(hidden @ weight.T, target)`` without materializing the (tokens x vocab) logits.

    ``hidden`` (..., H), ``weight`` (V, H) (an LM head's weight), ``target`` (...) of class indices.
    Tokens are processed ``chunk_size`` at a time (default: logits chunk ~ size of ``hidden``), the
    gradient is formed in the forward, and dW is accumulated in fp32.

    Vocab parallel: when ``weight`` is a DTensor sharded ``Shard(0)`` on a 1-D (TP) mesh, each rank uses its
    vocab rows and only three numbers per token cross ranks (max, sum-exp, target logit). ``hidden`` may be
    a DTensor on that mesh (any placements; it is gathered to Replicate and its gradient reduce-scattered
    back) or a plain tensor holding the same tokens on every TP rank. The loss is the same on all ranks.

    Example::

        >>> import torch, torch.nn.functional as F
        >>> from meshkit.kernels import fused_linear_cross_entropy
        >>> h, w, t = torch.randn(6, 8), torch.randn(11, 8), torch.randint(0, 11, (6,))
        >>> torch.allclose(fused_linear_cross_entropy(h, w, t), F.cross_entropy(h @ w.T, t), atol=1e-5)
        True
    """
    _check(hidden, weight, target, ignore_index, reduction)
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"fused_linear_cross_entropy: `chunk_size={chunk_size}` must be >= 1 (or None).")
    if not is_dtensor(weight) and not (torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)):
        return _loss_only(hidden, weight, target, ignore_index, reduction, chunk_size)
    if not is_dtensor(weight):
        if is_dtensor(hidden):
            raise ValueError("fused_linear_cross_entropy: `hidden` is a DTensor but `weight` is not.")
        h2, t2 = hidden.reshape(-1, hidden.shape[-1]), target.reshape(-1).long()
        if chunk_size is None:
            return _flce_op(h2, weight, t2, ignore_index, reduction)[0]
        return _VocabParallelFLCE.apply(h2.contiguous(), weight.contiguous(), t2.contiguous(), ignore_index,
                                        reduction, 0, None, chunk_size)  # fmt: skip
    if not (torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)):
        return _loss_only(hidden, weight, target, ignore_index, reduction, chunk_size)
    mesh = weight.device_mesh
    (place,) = weight.placements if mesh.ndim == 1 else (None,)
    if mesh.ndim != 1 or not isinstance(place, (Shard, Replicate)) or (isinstance(place, Shard) and place.dim != 0):
        raise ValueError(
            f"fused_linear_cross_entropy: `weight.placements={weight.placements}` on a {mesh.ndim}-D mesh; expected "
            "Shard(0) (vocab parallel) or Replicate on a 1-D TP mesh."
        )
    if is_dtensor(hidden):
        if hidden.device_mesh != mesh:
            raise ValueError("fused_linear_cross_entropy: `hidden` and `weight` DTensors must share one mesh.")
        # Gather tokens (e.g. sequence-parallel Shard(1)); the local dh is partial over vocab shards.
        from torch.distributed.tensor import Partial

        h_local = hidden.redistribute(mesh, [Replicate()]).to_local(grad_placements=[Partial()])
    else:
        h_local = all_reduce_grad(hidden, [mesh.get_group(0)]) if isinstance(place, Shard) else hidden
    if is_dtensor(target):
        target = target.redistribute(mesh, [Replicate()]).to_local()
    w_local = weight.to_local()
    h2, t2 = h_local.reshape(-1, h_local.shape[-1]), target.reshape(-1).long()
    if isinstance(place, Replicate):
        return _flce_op(h2, w_local, t2, ignore_index, reduction)[0]
    # Shard(0) splits rows like torch.chunk: rank r holds rows [r * ceil(V/n), ...).
    vocab_start = mesh.get_local_rank() * (-(-weight.shape[0] // mesh.size()))
    return _VocabParallelFLCE.apply(h2.contiguous(), w_local.contiguous(), t2.contiguous(), ignore_index, reduction,
                                    vocab_start, mesh.get_group(0), chunk_size)  # fmt: skip
