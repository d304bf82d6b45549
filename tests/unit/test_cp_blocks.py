"""The per-block identities context-parallel attention rests on, in one process.

Attention over keys split into blocks, each block's (out, lse) merged by log-sum-exp, equals attention
over all keys; each block's backward, given the *merged* out and lse, yields gradients that add up to
the full ones. The same checks run on CUDA (flash / efficient kernels) in tests/gpu/test_cp_cuda.py.
Also: the layouts, derived by hand.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from meshkit.plugins.context_parallel import attention as impl
from meshkit.plugins.context_parallel import check_cp_heads, layout_index, sequence_positions, shard_sequence


def check_blocks(device: str, dtype: torch.dtype, causal: bool, hkv: int, atol: float) -> None:
    """Query rows 12..20 attend keys 0..12 (full) and 12..20 (diagonal block), merged by LSE, vs full SDPA."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 20, 16, generator=g).to(device, dtype)
    k, v = (torch.randn(2, hkv, 20, 16, generator=g).to(device, dtype) for _ in range(2))
    dout = torch.randn(2, 4, 20, 16, generator=g).to(device, dtype)
    scale = 1 / math.sqrt(16)
    # Queries rows 12..20 against keys 0..12 (full) and 12..20 (diagonal block, causal when causal=True).
    qs, prev, diag = slice(12, 20), slice(0, 12), slice(12, 20)
    out, lse = impl.block_forward(q[:, :, qs], k[:, :, diag], v[:, :, diag], causal, scale)
    acc = torch.float64 if dtype == torch.float64 else torch.float32  # merge precision
    out, lse = out.to(acc), lse.to(acc)
    o2, l2 = impl.block_forward(q[:, :, qs], k[:, :, prev], v[:, :, prev], False, scale)
    impl.merge(out, lse, o2, l2)

    full = [t.clone().requires_grad_() for t in (q, k, v)]
    mask = torch.ones(20, 20, dtype=torch.bool, device=device).tril() if causal else None  # query row i sees keys <= i
    ref = F.scaled_dot_product_attention(*full, attn_mask=mask, scale=scale, enable_gqa=True)
    ref[:, :, qs].backward(dout[:, :, qs])
    torch.testing.assert_close(out.to(dtype), ref[:, :, qs].detach(), atol=atol, rtol=0)

    dq = torch.zeros_like(q[:, :, qs], dtype=acc)
    dk, dv = torch.zeros_like(k, dtype=acc), torch.zeros_like(v, dtype=acc)
    for ks, c in ((diag, causal), (prev, False)):
        sq = (slice(None), slice(None), qs)
        dq_b, dk_b, dv_b = impl.block_backward(dout[sq], q[sq], k[:, :, ks], v[:, :, ks], out, lse, c, scale)
        dq += dq_b
        dk[:, :, ks] += dk_b
        dv[:, :, ks] += dv_b
    for got, want in ((dq, full[0].grad[:, :, qs]), (dk, full[1].grad), (dv, full[2].grad)):
        torch.testing.assert_close(got.to(dtype), want, atol=atol, rtol=0)


@pytest.mark.parametrize("hkv", [4, 2])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dtype,atol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
def test_blocks_merge_to_full_attention_cpu(dtype, atol, causal, hkv):
    check_blocks("cpu", dtype, causal, hkv, atol)


def test_layouts_by_hand():
    # 12 tokens, cp=3, load-balanced: 6 chunks of 2, rank r holds chunks r and 5-r.
    assert layout_index(12, 3, "load_balanced").tolist() == [0, 1, 10, 11, 2, 3, 8, 9, 4, 5, 6, 7]
    assert sequence_positions(12, cp_rank=1, cp=3).tolist() == [2, 3, 8, 9]
    assert sequence_positions(12, cp_rank=2, cp=3, layout="contiguous").tolist() == [8, 9, 10, 11]
    x = torch.arange(24).view(2, 12)
    assert shard_sequence(x, 0, 3, dim=1).tolist() == [[0, 1, 10, 11], [12, 13, 22, 23]]


def test_shard_sequence_errors():
    with pytest.raises(ValueError, match=r"`x.shape\[0\]=10` must be divisible by 2·cp=4 for `layout='load_balanced'`"):
        shard_sequence(torch.arange(10), 0, 2, dim=0)
    with pytest.raises(ValueError, match=r"`x.shape\[0\]=10` must be divisible by cp=4 for `layout='contiguous'`"):
        shard_sequence(torch.arange(10), 0, 4, dim=0, layout="contiguous")
    with pytest.raises(ValueError, match=r"`cp_rank=2` must be in \[0, cp=2\)"):
        shard_sequence(torch.arange(8), 2, 2, dim=0)
    with pytest.raises(ValueError, match=r"`layout='zigzag'` is not one of"):
        shard_sequence(torch.arange(8), 0, 2, dim=0, layout="zigzag")


def test_cp_heads_rule():
    # Ulysses: heads per TP rank divisible by cp; kv heads per TP rank a multiple (split) or divisor (replicated).
    for heads, kv, tp, cp in [(32, 8, 4, 2), (8, 8, 1, 4), (8, 2, 1, 4), (8, 1, 1, 8), (16, 2, 4, 4), (6, 6, None, 3)]:
        check_cp_heads(heads, kv, tp, cp, "ulysses")
    check_cp_heads(8, None, 2, 4, "ulysses")  # no GQA: kv heads = heads
    for attention in ("ring", "allgather"):  # no head rule
        check_cp_heads(6, 3, 1, 4, attention)
    per_tp_rank = r"`cp_attention='ulysses'` with `cp=4` and `tp=2` needs the heads per TP rank \(6\)"
    with pytest.raises(ValueError, match=per_tp_rank):
        check_cp_heads(12, 12, 2, 4, "ulysses")
    with pytest.raises(ValueError, match=r"kv heads per TP rank \(3\) either divisible by cp or dividing it"):
        check_cp_heads(24, 6, 2, 4, "ulysses")  # 12 heads per TP rank fit cp=4; 3 kv heads neither split nor replicate
    local = r"`attention='ulysses'` with `cp=4` needs `num_heads=6` divisible.*fits the heads \(\[2, 3, 6\]\)"
    with pytest.raises(ValueError, match=local):
        check_cp_heads(6, 6, None, 4, "ulysses", option="attention")
    with pytest.raises(ValueError, match=r"`num_kv_heads=3` either divisible by cp or dividing it"):
        check_cp_heads(12, 3, None, 4, "ulysses")


def test_shard_batch_refuses_unshifted_hf_labels():
    # An HF collator's labels are a copy of input_ids; under cp meshkit reads `labels` as shifted, so the batch
    # would silently train on the current token. One rank is enough: the check runs before any cut.
    import torch.distributed as dist

    from meshkit.plugins.context_parallel import shard_batch

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]])
        with pytest.raises(ValueError, match=r"batch\['labels'\] equals batch\['input_ids'\].*Drop 'labels'"):
            shard_batch({"input_ids": ids, "labels": ids.clone()}, dist.group.WORLD)
        padded = ids.clone()
        padded[0, -2:] = -100  # the collator's padding mask does not hide it
        with pytest.raises(ValueError, match="unshifted convention"):
            shard_batch({"input_ids": ids, "labels": padded}, dist.group.WORLD)
        shifted = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)
        assert shard_batch({"input_ids": ids, "labels": shifted}, dist.group.WORLD)["labels"].tolist() == shifted.tolist()
        flat = torch.full((1, 8), 3)  # a constant row is its own shift: nothing to tell apart, accepted
        assert shard_batch({"input_ids": flat, "labels": flat.clone()}, dist.group.WORLD)["labels"].tolist() == flat.tolist()
    finally:
        dist.destroy_process_group()
