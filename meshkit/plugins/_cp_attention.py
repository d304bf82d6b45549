"""Private helpers of :mod:`meshkit.plugins.context_parallel`: layouts, per-block attention, the three variants.

Shapes: q (B, H, T_loc, D), k and v (B, Hkv, T_loc, D) with ``H % Hkv == 0`` (GQA); ``T_loc`` is the
local (sharded) sequence, ``T = cp * T_loc`` the full one. A *chunk* is ``T // (2 cp)`` tokens in the
load-balanced layout (rank r holds chunks r and 2cp-1-r) and ``T // cp`` in the contiguous one.

Per-block attention returns the log-sum-exp (LSE) of each query row so partial outputs over disjoint
key sets merge exactly: ``lse = logaddexp(l1, l2)``, ``out = o1·e^(l1-lse) + o2·e^(l2-lse)``. The
backward of a block reuses the *final* output and LSE (the flash-attention identity: P = exp(S - lse),
dS = P ∘ (dP - rowsum(dO ∘ O))), so the per-block gradients add up to the full gradient.
"""

from __future__ import annotations

import math
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

P2P_TIMEOUT = timedelta(seconds=120)
"""Timeout of every wait on a point-to-point op or collective issued here."""

# torch 2.13 renames the tensor collectives (*_single) and deprecates the old names; both checked on 2.6-2.13.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

VARIANTS = ("ring", "allgather", "ulysses")
LAYOUTS = ("load_balanced", "contiguous")


# ---- layouts ----------------------------------------------------------------------------------------
def chunks_of_rank(rank: int, cp: int, layout: str) -> list[int]:
    """Global chunk indices rank ``rank`` holds, in local order."""
    return [rank, 2 * cp - 1 - rank] if layout == "load_balanced" else [rank]


def layout_index(seq_len: int, cp: int, layout: str, device: Any = None) -> torch.Tensor:
    """(T,) natural positions in layout order: rank 0's shard first, then rank 1's, ... ."""
    n_chunks = 2 * cp if layout == "load_balanced" else cp
    chunk = seq_len // n_chunks
    base = torch.arange(seq_len, device=device).view(n_chunks, chunk)
    return torch.cat([base[c] for r in range(cp) for c in chunks_of_rank(r, cp, layout)])


def check_layout(seq_len: int, cp: int, layout: str, what: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"context_parallel: `layout={layout!r}` is not one of {LAYOUTS}.")
    n = 2 * cp if layout == "load_balanced" else cp
    if seq_len % n:
        rule = "2·cp" if layout == "load_balanced" else "cp"
        raise ValueError(
            f"context_parallel: `{what}={seq_len}` must be divisible by {rule}={n} for `layout={layout!r}` "
            f"with `cp={cp}` (each rank holds {'two equal chunks' if n == 2 * cp else 'one equal chunk'}). "
            f"Pad the sequence to a multiple of {n}."
        )


# ---- per-block attention with LSE ---------------------------------------------------------------------
def _expand_kv(k: torch.Tensor, n_rep: int) -> torch.Tensor:
    return k if n_rep == 1 else k.repeat_interleave(n_rep, dim=1)


def _fold_kv(dk: torch.Tensor, n_rep: int) -> torch.Tensor:
    if n_rep == 1:
        return dk
    b, h, t, d = dk.shape
    return dk.view(b, h // n_rep, n_rep, t, d).sum(2)


def block_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q (B,H,Tq,D) over k,v (B,Hkv,Tk,D) -> out (B,H,Tq,D), lse (B,H,Tq) in fp32/fp64.

    ``causal`` is only used on square blocks (Tq == Tk), so the diagonal's alignment never matters.
    """
    n_rep = q.shape[1] // k.shape[1]
    k, v = _expand_kv(k, n_rep), _expand_kv(v, n_rep)
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    elif q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)[:2]
    elif q.device.type == "cuda":
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, None, True, 0.0, causal, scale=scale
        )[:2]
        lse = lse[..., : q.shape[2]]  # the kernel pads its LSE to a multiple of 32 rows
    else:
        raise ValueError(f"context_parallel: device type {q.device.type!r} is not supported (cpu and cuda are).")
    return out, lse


def block_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv of one block given the *final* out and lse of its query rows; dk, dv folded to Hkv heads."""
    n_rep = q.shape[1] // k.shape[1]
    ke, ve = _expand_kv(k, n_rep), _expand_kv(v, n_rep)
    out, dout = out.to(q.dtype), dout.to(q.dtype)
    if q.device.type == "cpu":
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, ke, ve, out, lse, 0.0, causal, scale=scale
        )
    elif q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16):
        tq, tk = q.shape[2], k.shape[2]
        zero = torch.zeros((), dtype=torch.int64, device=q.device)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout, q, ke, ve, out, lse.contiguous(), None, None, tq, tk, 0.0, causal, zero, zero, scale=scale
        )
    else:
        padded = torch.full((*lse.shape[:2], 32 * math.ceil(lse.shape[2] / 32)), float("inf"), device=q.device)
        padded[..., : lse.shape[2]] = lse
        zero = torch.zeros((), dtype=torch.int64, device=q.device)
        dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            dout, q, ke, ve, None, out, padded, zero, zero, 0.0, [True, True, True, False], causal, scale=scale
        )
    return dq, _fold_kv(dk, n_rep), _fold_kv(dv, n_rep)


def merge(out: torch.Tensor, lse: torch.Tensor, o2: torch.Tensor, l2: torch.Tensor) -> None:
    """Merge the partial (o2, l2) into (out, lse) in place; both cover the same query rows."""
    new = torch.logaddexp(lse, l2.to(lse.dtype))
    out.mul_(torch.exp(lse - new).unsqueeze(-1)).add_(o2.to(out.dtype) * torch.exp(l2 - new).unsqueeze(-1))
    lse.copy_(new)


def _plan_backward(dout, q, kv, out, lse, qs: slice, ks: slice, causal: bool, scale: float):
    """:func:`block_backward` of query rows ``qs`` against key rows ``ks`` of the stacked (2, ...) ``kv``."""
    sl = (slice(None), slice(None), qs)
    k, v = kv[0][:, :, ks], kv[1][:, :, ks]
    return block_backward(dout[sl], q[sl], k, v, out[sl], lse[sl], causal, scale)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# ---- communication --------------------------------------------------------------------------------------
def _wait(works: list[Any]) -> None:
    for w in works:
        w.wait(timeout=P2P_TIMEOUT)


def shift(send: torch.Tensor, group: ProcessGroup, tag: int) -> tuple[torch.Tensor, list[Any]]:
    """Start sending ``send`` to the next cp rank and receiving the previous rank's into a new buffer."""
    rank, cp = dist.get_rank(group), dist.get_world_size(group)
    recv = torch.empty_like(send)
    nxt, prv = dist.get_global_rank(group, (rank + 1) % cp), dist.get_global_rank(group, (rank - 1) % cp)
    ops = [dist.P2POp(dist.isend, send, nxt, group, tag), dist.P2POp(dist.irecv, recv, prv, group, tag)]
    return recv, dist.batch_isend_irecv(ops)


# ---- ring ---------------------------------------------------------------------------------------------
def ring_plan(step: int, rank: int, cp: int, causal: bool, layout: str, t_loc: int) -> tuple[slice, slice, bool] | None:
    """(query rows, key rows, causal) this rank attends at ``step`` (kv from rank - step), or None."""
    full, half = slice(0, t_loc), t_loc // 2
    src = (rank - step) % cp
    if not causal:
        return full, full, False
    if src == rank:
        return full, full, True  # both layouts keep local chunks in increasing order
    if layout == "contiguous":
        return (full, full, False) if src < rank else None
    if src < rank:  # its chunks src < r < 2cp-1-src: only its first chunk is in our past, for both our chunks
        return full, slice(0, half), False
    return slice(half, t_loc), full, False  # src > r: only our late chunk 2cp-1-r sees both of its chunks


class RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q, k, v, group, causal, layout, scale):  # type: ignore[override]
        rank, cp = dist.get_rank(group), dist.get_world_size(group)
        t_loc = q.shape[2]
        kv = torch.stack([k, v]).contiguous()  # (2, B, Hkv, T_loc, D): one message per hop
        out = lse = None
        for step in range(cp):
            if step + 1 < cp:
                nxt, works = shift(kv, group, tag=0)
            plan = ring_plan(step, rank, cp, causal, layout, t_loc)
            if plan is not None:
                qs, ks, c = plan
                o, l = block_forward(q[:, :, qs], kv[0][:, :, ks], kv[1][:, :, ks], c, scale)
                if out is None:  # step 0 covers every row
                    out, lse = o.to(_acc_dtype(q.dtype)), l.to(_acc_dtype(q.dtype))
                else:
                    o_part, l_part = out[:, :, qs], lse[:, :, qs]
                    merge(o_part, l_part, o, l)
            if step + 1 < cp:
                _wait(works)
                kv = nxt
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.causal, ctx.layout, ctx.scale = group, causal, layout, scale
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx: Any, dout):  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        group = ctx.group
        rank, cp = dist.get_rank(group), dist.get_world_size(group)
        t_loc = q.shape[2]
        kv = torch.stack([k, v]).contiguous()
        dq = torch.zeros(q.shape, dtype=_acc_dtype(q.dtype), device=q.device)
        acc_in = acc_works = None
        for step in range(cp):
            if step + 1 < cp:
                nxt, works = shift(kv, group, tag=1)
            dkv = torch.zeros(kv.shape, dtype=_acc_dtype(q.dtype), device=q.device)
            plan = ring_plan(step, rank, cp, ctx.causal, ctx.layout, t_loc)
            if plan is not None:
                qs, ks, c = plan
                dq_b, dk_b, dv_b = _plan_backward(dout, q, kv, out, lse, qs, ks, c, ctx.scale)
                dq[:, :, qs] += dq_b
                dkv[0][:, :, ks] += dk_b
                dkv[1][:, :, ks] += dv_b
            if acc_works is not None:  # the dK/dV accumulated so far for this kv block, from the previous rank
                _wait(acc_works)
                dkv += acc_in
            if cp == 1:
                acc_in = dkv
                break
            # Pass the accumulator on; after cp hops it is back at the owner of the kv block.
            acc_in, acc_works = shift(dkv, group, tag=2)
            if step + 1 < cp:
                _wait(works)
                kv = nxt
        if acc_works is not None:
            _wait(acc_works)
        return dq.to(q.dtype), acc_in[0].to(k.dtype), acc_in[1].to(v.dtype), None, None, None, None


# ---- all-gather -----------------------------------------------------------------------------------------
def _gather_kv(k: torch.Tensor, v: torch.Tensor, group: ProcessGroup, layout: str) -> torch.Tensor:
    """All-gather k, v -> (2, B, Hkv, T, D) in natural sequence order."""
    cp = dist.get_world_size(group)
    kv = torch.stack([k, v]).contiguous()
    gathered = torch.empty((cp * 2, *kv.shape[1:]), dtype=kv.dtype, device=kv.device)  # gloo: flat along dim 0
    _wait([_all_gather(gathered, kv, group=group, async_op=True)])
    gathered = gathered.view(cp, *kv.shape)
    t = cp * k.shape[2]
    natural = torch.argsort(layout_index(t, cp, layout, device=k.device))
    return gathered.permute(1, 2, 3, 0, 4, 5).reshape(2, *k.shape[:2], t, k.shape[3])[:, :, :, natural]


def allgather_plan(rank: int, cp: int, causal: bool, layout: str, t_loc: int) -> list[tuple[slice, slice, bool]]:
    """(local query rows, global key rows, causal) blocks covering this rank's attention."""
    if not causal:
        return [(slice(0, t_loc), slice(0, cp * t_loc), False)]
    chunks = chunks_of_rank(rank, cp, layout)
    size = t_loc // len(chunks)
    plan = []
    for i, c in enumerate(chunks):
        rows = slice(i * size, (i + 1) * size)
        if c > 0:
            plan.append((rows, slice(0, c * size), False))
        plan.append((rows, slice(c * size, (c + 1) * size), True))
    return plan


class AllGatherAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q, k, v, group, causal, layout, scale):  # type: ignore[override]
        rank, cp = dist.get_rank(group), dist.get_world_size(group)
        kv = _gather_kv(k, v, group, layout)
        out = torch.empty(q.shape, dtype=_acc_dtype(q.dtype), device=q.device)
        lse = torch.empty(q.shape[:3], dtype=_acc_dtype(q.dtype), device=q.device)
        done: set[int] = set()
        for qs, ks, c in allgather_plan(rank, cp, causal, layout, q.shape[2]):
            o, l = block_forward(q[:, :, qs], kv[0][:, :, ks], kv[1][:, :, ks], c, scale)
            if qs.start in done:
                merge(out[:, :, qs], lse[:, :, qs], o, l)
            else:
                out[:, :, qs], lse[:, :, qs] = o, l
                done.add(qs.start)
        # The gathered K/V are not kept: backward gathers again, so saved memory stays 1/cp.
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.causal, ctx.layout, ctx.scale = group, causal, layout, scale
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx: Any, dout):  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        group = ctx.group
        rank, cp = dist.get_rank(group), dist.get_world_size(group)
        kv = _gather_kv(k, v, group, ctx.layout)
        dq = torch.zeros(q.shape, dtype=_acc_dtype(q.dtype), device=q.device)
        dkv = torch.zeros(kv.shape, dtype=_acc_dtype(q.dtype), device=q.device)
        for qs, ks, c in allgather_plan(rank, cp, ctx.causal, ctx.layout, q.shape[2]):
            dq_b, dk_b, dv_b = _plan_backward(dout, q, kv, out, lse, qs, ks, c, ctx.scale)
            dq[:, :, qs] += dq_b
            dkv[0][:, :, ks] += dk_b
            dkv[1][:, :, ks] += dv_b
        # Natural order -> each rank's shard (cp, 2, B, Hkv, T_loc, D), then sum the shards over the group.
        idx = layout_index(kv.shape[3], cp, ctx.layout, device=q.device)
        shards = dkv[:, :, :, idx].unflatten(3, (cp, -1)).permute(3, 0, 1, 2, 4, 5).flatten(0, 1).contiguous()
        mine = torch.empty((2, *shards.shape[1:]), dtype=shards.dtype, device=shards.device)
        _wait([_reduce_scatter(mine, shards, group=group, async_op=True)])
        return dq.to(q.dtype), mine[0].to(k.dtype), mine[1].to(v.dtype), None, None, None, None


# ---- Ulysses --------------------------------------------------------------------------------------------
class _AllToAll(torch.autograd.Function):
    """all_to_all_single over dim 0 (cp equal blocks); its own adjoint."""

    @staticmethod
    def forward(ctx: Any, x, group):  # type: ignore[override]
        ctx.group = group
        x = x.contiguous()
        out = torch.empty_like(x)
        _wait([dist.all_to_all_single(out, x, group=group, async_op=True)])
        return out

    @staticmethod
    def backward(ctx: Any, grad):  # type: ignore[override]
        grad = grad.contiguous()  # empty_like keeps a non-contiguous input's strides; the collective wants flat
        out = torch.empty_like(grad)
        _wait([dist.all_to_all_single(out, grad, group=ctx.group, async_op=True)])
        return out, None


def seq_to_heads(x: torch.Tensor, group: ProcessGroup, order: torch.Tensor) -> torch.Tensor:
    """(B, H, T_loc, D) sequence-sharded -> (B, H/cp, T, D) head-sharded, natural order (``order``)."""
    cp = dist.get_world_size(group)
    b, h, t, d = x.shape
    blocks = x.view(b, cp, h // cp, t, d).transpose(0, 1)  # (cp, B, H/cp, T_loc, D): block j goes to rank j
    recv = _AllToAll.apply(blocks, group)  # block j: rank j's sequence shard of our heads
    return recv.permute(1, 2, 0, 3, 4).reshape(b, h // cp, cp * t, d)[:, :, order]


def heads_to_seq(x: torch.Tensor, group: ProcessGroup, index: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`seq_to_heads`: (B, H/cp, T, D) natural -> (B, H, T_loc, D) this rank's shard."""
    cp = dist.get_world_size(group)
    b, hl, t, d = x.shape
    blocks = x[:, :, index].view(b, hl, cp, t // cp, d).permute(2, 0, 1, 3, 4)  # (cp, B, H/cp, T_loc, D)
    recv = _AllToAll.apply(blocks, group)  # block j: our shard of rank j's heads
    return recv.transpose(0, 1).reshape(b, cp * hl, t // cp, d)


def ulysses_attention(q, k, v, group, causal: bool, layout: str, scale: float) -> torch.Tensor:
    cp = dist.get_world_size(group)
    hkv = k.shape[1]
    if hkv % cp:  # cp % hkv == 0 was checked: replicate each kv head so every rank gets the one its q heads use
        k, v = k.repeat_interleave(cp // hkv, dim=1), v.repeat_interleave(cp // hkv, dim=1)
    index = layout_index(cp * q.shape[2], cp, layout, device=q.device)
    order = torch.argsort(index)
    qh, kh, vh = (seq_to_heads(t, group, order) for t in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, is_causal=causal, scale=scale, enable_gqa=True)
    return heads_to_seq(out, group, index)
