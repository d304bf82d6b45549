"""Context-parallel attention: per-block math, the ring / all-gather / Ulysses variants, and the entry point.

Shapes: q (B, H, T_loc, D), k and v (B, Hkv, T_loc, D) with ``H % Hkv == 0`` (GQA); ``T_loc`` is the
local (sharded) sequence, ``T = cp * T_loc`` the full one, cut by a layout of :mod:`.layout`.

Per-block attention returns the log-sum-exp (LSE) of each query row so partial outputs over disjoint
key sets merge exactly: ``lse = logaddexp(l1, l2)``, ``out = o1·e^(l1-lse) + o2·e^(l2-lse)``. The
backward of a block reuses the *final* output and LSE (the flash-attention identity: P = exp(S - lse),
dS = P ∘ (dP - rowsum(dO ∘ O))), so the per-block gradients add up to the full gradient.

Example (one block: the whole sequence, one process)::

    >>> import torch
    >>> q = torch.randn(1, 2, 4, 8)                                       # (B, H, T, D)
    >>> out, lse = block_forward(q, q, q, causal=True, scale=8**-0.5)
    >>> tuple(out.shape), tuple(lse.shape)
    ((1, 2, 4, 8), (1, 2, 4))
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from meshkit.plugins.context_parallel.layout import (
    P2P_TIMEOUT,
    Group,
    check_layout,
    chunks_of_rank,
    layout_index,
    process_group,
)

__all__ = [
    "CP_ATTENTIONS",
    "check_cp_heads",
    "context_parallel_attention",
    "block_forward",
    "block_backward",
    "merge",
    "RingAttention",
    "AllGatherAttention",
    "ulysses_attention",
]

CP_ATTENTIONS: tuple[str, ...] = ("ring", "allgather", "ulysses")
"""The context-parallel attention schemes (``attention=``)."""


def _all_gather(out: torch.Tensor, inp: torch.Tensor, group: ProcessGroup) -> Any:
    # torch 2.13 renames the tensor collectives (*_single) and deprecates the old names; both checked on 2.6-2.13.
    # Looked up per call, so a benchmark wrapping torch.distributed's entry points sees every call.
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, inp, group=group, async_op=True)


def _reduce_scatter(out: torch.Tensor, inp: torch.Tensor, group: ProcessGroup) -> Any:
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor  # as in _all_gather
    return fn(out, inp, group=group, async_op=True)


# ---- the heads rule ------------------------------------------------------------------------------------
def _ulysses_fits(heads: int, kv_heads: int, cp: int) -> bool:
    """Ulysses splits heads over cp: q heads divisible by cp; kv heads split (multiple) or replicated (divisor)."""
    return heads % cp == 0 and (kv_heads % cp == 0 or cp % kv_heads == 0)


def check_cp_heads(
    heads: int,
    kv_heads: int | None,
    tp: int | None,
    cp: int,
    attention: str,
    *,
    owner: str = "context_parallel",
    option: str = "cp_attention",
) -> None:
    """Raise ValueError unless ``attention`` can run with ``cp`` on these heads; the one home of that rule.

    Only ``"ulysses"`` constrains heads: it splits heads over the cp ranks, so the heads per TP rank
    must be divisible by cp and the kv heads per TP rank a multiple of cp (split) or a divisor of it
    (replicated). ``heads``/``kv_heads`` are the model's (``kv_heads=None``: no GQA) and ``tp`` its TP
    degree; ``tp=None`` says they are already one TP rank's (what the attention call sees). ``owner``
    and ``option`` name the caller and the option the user set, for the message.

    Example::

        >>> check_cp_heads(32, 8, tp=4, cp=2, attention="ulysses")   # 8 heads, 2 kv heads per TP rank: fits
        >>> check_cp_heads(12, 4, tp=2, cp=4, attention="ulysses")   # doctest: +IGNORE_EXCEPTION_DETAIL
        Traceback (most recent call last):
        ValueError: context_parallel: `cp_attention='ulysses'` with `cp=4` and `tp=2` needs the heads per TP rank ...
    """
    if attention != "ulysses":
        return
    kv_heads = kv_heads or heads
    local, local_kv = (heads, kv_heads) if tp is None else (heads // tp, max(1, kv_heads // tp))
    if _ulysses_fits(local, local_kv, cp):
        return
    fits = [c for c in range(2, local + 1) if _ulysses_fits(local, local_kv, c)]
    sizes = (
        f"`num_heads={local}` divisible by cp and `num_kv_heads={local_kv}`"
        if tp is None
        else f"the heads per TP rank ({local}) divisible by cp and the kv heads per TP rank ({local_kv})"
    )
    raise ValueError(
        f"{owner}: `{option}='ulysses'` with `cp={cp}`{'' if tp is None else f' and `tp={tp}`'} needs {sizes} "
        "either divisible by cp or dividing it (kv heads are then replicated). "
        f"Use {option}='ring' or 'allgather', or a cp that fits the heads ({fits or 'none above 1'})."
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


def _save(ctx: Any, q, k, v, out, lse, group: ProcessGroup, causal: bool, layout: str, scale: float) -> torch.Tensor:
    """Keep what a variant's backward needs (local q, k, v, the merged out and lse); return out in q's dtype."""
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.group, ctx.causal, ctx.layout, ctx.scale = group, causal, layout, scale
    return out.to(q.dtype)


def _restore(ctx: Any) -> tuple:
    """(q, k, v, out, lse, group, rank, cp) saved by :func:`_save`."""
    return (*ctx.saved_tensors, ctx.group, dist.get_rank(ctx.group), dist.get_world_size(ctx.group))


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
    """Ring attention: K/V hop rank to rank (overlapped with the block in hand), dK/dV accumulators follow.

    ``RingAttention.apply(q, k, v, group, causal, layout, scale)``; call :func:`context_parallel_attention`.
    """

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
        return _save(ctx, q, k, v, out, lse, group, causal, layout, scale)

    @staticmethod
    def backward(ctx: Any, dout):  # type: ignore[override]
        q, k, v, out, lse, group, rank, cp = _restore(ctx)
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
    _wait([_all_gather(gathered, kv, group)])
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
    """All-gather K/V, attend the local queries; backward gathers again and reduce-scatters dK/dV (Llama 3).

    ``AllGatherAttention.apply(q, k, v, group, causal, layout, scale)``; call :func:`context_parallel_attention`.
    """

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
        return _save(ctx, q, k, v, out, lse, group, causal, layout, scale)

    @staticmethod
    def backward(ctx: Any, dout):  # type: ignore[override]
        q, k, v, out, lse, group, rank, cp = _restore(ctx)
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
        _wait([_reduce_scatter(mine, shards, group)])
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
    """All-to-all to head-sharded, full-sequence SDPA on H/cp heads, all-to-all back (heads: :func:`check_cp_heads`)."""
    cp = dist.get_world_size(group)
    hkv = k.shape[1]
    if hkv % cp:  # cp % hkv == 0 was checked: replicate each kv head so every rank gets the one its q heads use
        k, v = k.repeat_interleave(cp // hkv, dim=1), v.repeat_interleave(cp // hkv, dim=1)
    index = layout_index(cp * q.shape[2], cp, layout, device=q.device)
    order = torch.argsort(index)
    qh, kh, vh = (seq_to_heads(t, group, order) for t in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, is_causal=causal, scale=scale, enable_gqa=True)
    return heads_to_seq(out, group, index)


# ---- entry point ----------------------------------------------------------------------------------------
def _check_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: int, attention: str, layout: str) -> None:
    if attention not in CP_ATTENTIONS:
        raise ValueError(f"context_parallel_attention: `attention={attention!r}` is not one of {CP_ATTENTIONS}.")
    if q.dim() != 4 or k.dim() != 4 or v.shape != k.shape:
        raise ValueError(
            "context_parallel_attention: q, k, v must be (B, H, T_local, D) with k and v the same shape; got "
            f"`q.shape={tuple(q.shape)}`, `k.shape={tuple(k.shape)}`, `v.shape={tuple(v.shape)}` (value heads of "
            "another width than the query/key heads, as multi-head latent attention has them, are not implemented). "
            "Train this model without cp (cp=1)."
        )
    if q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:] or q.shape[1] % k.shape[1]:
        raise ValueError(
            f"context_parallel_attention: `q.shape={tuple(q.shape)}` and `k.shape={tuple(k.shape)}` must share B, "
            "T_local and D, and the kv heads must divide the query heads (a family attending over keys of another "
            "length than its queries, e.g. extra memory tokens, is not implemented). Train this model without cp "
            "(cp=1)."
        )
    check_layout(cp * q.shape[2], cp, layout, "seq_len")
    # q and k carry this TP rank's heads already: tp=None.
    check_cp_heads(q.shape[1], k.shape[1], None, cp, attention, owner="context_parallel_attention", option="attention")


def context_parallel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: Group,
    *,
    causal: bool = True,
    attention: str = "ring",
    layout: str = "load_balanced",
    scale: float | None = None,
) -> torch.Tensor:
    """Scaled dot-product attention of sequence-sharded q (B, H, T/cp, D), k, v (B, Hkv, T/cp, D) over ``group``.

    Returns this rank's rows of the full-sequence attention, (B, H, T/cp, D), differentiable in q, k, v.
    ``group`` is the cp ProcessGroup or a 1-D DeviceMesh; every rank of it must call with the same
    shapes and options. ``layout`` says how the shards were cut (see :func:`.layout.shard_sequence`).
    Errors in the arguments are raised before any communication.

    Example (on every rank of a 1-D cp mesh ``mesh``)::

        >>> out = context_parallel_attention(q_local, k_local, v_local, mesh, attention="allgather")  # doctest: +SKIP
    """
    pg = process_group(group)
    cp = dist.get_world_size(pg)
    _check_attention(q, k, v, cp, attention, layout)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if attention == "ulysses":
        return ulysses_attention(q, k, v, pg, causal, layout, scale)
    fn = RingAttention if attention == "ring" else AllGatherAttention
    return fn.apply(q, k, v, pg, causal, layout, scale)
