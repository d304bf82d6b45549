"""Context-parallel attention on gloo: every variant equals full-sequence SDPA, forward and backward.

One pool of 4 ranks: world 4 uses all of them, world 2 the inner axis of a (2, 2) mesh (two cp groups
side by side). Full q, k, v are drawn identically on every rank; each rank attends its shards, the
output and dQ, dK, dV are gathered back and compared with F.scaled_dot_product_attention on the full
sequence, in fp64 (atol 1e-6) and fp32 (atol 1e-4).
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from tests.dist_pool import ProcessPool

_MESHES: dict[int, object] = {}


@pytest.fixture(scope="module")
def pool():
    with ProcessPool(world_size=4) as p:
        yield p


def _cp_mesh(world: int):
    """The 1-D cp mesh of size ``world`` this rank belongs to (cached: building groups is a collective)."""
    from torch.distributed.device_mesh import init_device_mesh

    if world not in _MESHES:
        if world == 4:
            _MESHES[4] = init_device_mesh("cpu", (4,), mesh_dim_names=("cp",))
        else:
            _MESHES[2] = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))["cp"]
    return _MESHES[world]


def _inputs(h: int, hkv: int, seq: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    shape = (2, h, seq, 6)  # B=2, odd chunk sizes (seq 24 at cp 4: chunks of 3), head dim 6
    q = torch.randn(shape, generator=g, dtype=torch.float64)
    k = torch.randn((2, hkv, seq, 6), generator=g, dtype=torch.float64)
    v = torch.randn((2, hkv, seq, 6), generator=g, dtype=torch.float64)
    w = torch.randn(shape, generator=g, dtype=torch.float64)  # loss = (out * w).sum()
    return [t.to(dtype) for t in (q, k, v, w)]


def _body_equivalence(rank, world_size, world, attention):
    from meshkit.plugins.context_parallel import context_parallel_attention, gather_sequence, shard_sequence

    mesh = _cp_mesh(world)
    cp, cp_rank = mesh.size(), mesh.get_local_rank()
    errors = {}
    hkvs = (8, 4, 2)
    cases = itertools.product(("load_balanced", "contiguous"), (True, False), hkvs, (torch.float64, torch.float32))
    for seed, (layout, causal, hkv, dtype) in enumerate(cases):
        q, k, v, w = _inputs(8, hkv, 24, dtype, seed)
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = F.scaled_dot_product_attention(*full, is_causal=causal, enable_gqa=True)
        (ref * w).sum().backward()
        local = [shard_sequence(t, cp_rank, cp, dim=2, layout=layout).requires_grad_() for t in (q, k, v)]
        out = context_parallel_attention(*local, mesh, causal=causal, attention=attention, layout=layout)
        (out * shard_sequence(w, cp_rank, cp, dim=2, layout=layout)).sum().backward()
        got = [out.detach()] + [t.grad for t in local]
        want = [ref.detach()] + [t.grad for t in full]
        for name, g_, w_ in zip(("out", "dq", "dk", "dv"), got, want):
            assert g_.dtype == dtype, (name, g_.dtype)
            diff = (gather_sequence(g_, mesh, dim=2, layout=layout) - w_).abs().max().item()
            errors[(layout, causal, hkv, str(dtype).split(".")[-1], name)] = diff
    return errors


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("attention", ["ring", "allgather", "ulysses"])
def test_cp_attention_matches_full_sdpa(pool, attention, world):
    results = pool.run(_body_equivalence, world, attention)
    assert len(results[0]) == 2 * 2 * 3 * 2 * 4  # layouts × causal × kv heads × dtypes × (out, dq, dk, dv)
    for errors in results:
        for key, diff in errors.items():
            tol = 1e-6 if "float64" in key else 1e-4
            assert diff <= tol, f"{attention} world={world} {key}: max |cp - full| = {diff:.3g} > {tol}"


def _body_validation(rank, world_size):
    from meshkit.plugins.context_parallel import context_parallel_attention

    mesh = _cp_mesh(4)
    x = torch.zeros(1, 8, 3, 4)  # T = 4·3 = 12: divisible by cp=4, not by 2·cp=8
    with pytest.raises(ValueError, match=r"`seq_len=12` must be divisible by 2·cp=8 for `layout='load_balanced'`"):
        context_parallel_attention(x, x, x, mesh, attention="ring")
    y = torch.zeros(1, 8, 3, 4)[:, :, :3]
    out = context_parallel_attention(y.clone(), y.clone(), y.clone(), mesh, attention="allgather", layout="contiguous")
    assert out.shape == y.shape  # the same T=12 is fine for the contiguous layout
    z = torch.zeros(1, 6, 4, 4)
    with pytest.raises(ValueError, match=r"`attention='ulysses'` with `cp=4` needs `num_heads=6` divisible"):
        context_parallel_attention(z, z, z, mesh, attention="ulysses")
    kv3 = torch.zeros(1, 3, 4, 4)
    q12 = torch.zeros(1, 12, 4, 4)
    with pytest.raises(ValueError, match=r"`num_kv_heads=3` either divisible by cp or dividing it"):
        context_parallel_attention(q12, kv3, kv3, mesh, attention="ulysses")
    with pytest.raises(ValueError, match=r"`attention='tree'` is not one of"):
        context_parallel_attention(z, z, z, mesh, attention="tree")
    with pytest.raises(ValueError, match=r"the kv heads must divide the query heads"):
        context_parallel_attention(q12, torch.zeros(1, 5, 4, 4), torch.zeros(1, 5, 4, 4), mesh)
    # After the errors every rank is still in step: a collective completes.
    return context_parallel_attention(q12, kv3, kv3, mesh, attention="ring").shape


def test_cp_attention_validation_errors_on_every_rank(pool):
    assert pool.run(_body_validation) == [torch.Size([1, 12, 4, 4])] * 4
