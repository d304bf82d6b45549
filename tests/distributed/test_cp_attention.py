"""Context parallelism on gloo: attention equals full-sequence SDPA; training equals one process.

One pool of 4 ranks: world 4 uses all of them, world 2 the inner axis of a (2, 2) mesh (two cp groups
side by side). Full q, k, v are drawn identically on every rank; each rank attends its shards, the
output and dQ, dK, dV are gathered back and compared with F.scaled_dot_product_attention on the full
sequence, in fp64 (atol 1e-6) and fp32 (atol 1e-4).

Training (plain torch loops, no Lightning): every rank trains the cp=4 model on its shard of each
batch (global positions from ``shard_batch``), averages gradients over the cp group (each rank's loss
is the mean over the same number of tokens, so the average of the local means is the global mean, and
the average of the local gradients the global gradient) and steps AdamW. The same rank also trains an
unsharded copy on the whole batch, with no communication; the losses must agree within rtol 1e-4.

Lightning (NDParallelStrategy with cp presets): against one process fed each step's whole global batch;
FSDP2 averages gradients over dp_shard × cp and the strategy reports the loss averaged over dp × cp, so
every rank's loss and the final parameters must match. All on one pool: spawning is the dominant cost.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.dist_pool import ProcessPool
from tests.distributed import training as T

_MESHES: dict[int, object] = {}
STEPS = 3
FIT_STEPS = 4
SEQ = 32  # 2·cp = 8 chunks of 4 tokens


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
    hkvs = (8, 4, 2) if attention == "ulysses" else (8, 2)  # ulysses: kv heads split (4, 8) or replicated (2)
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
    kv_cases = 3 if attention == "ulysses" else 2
    assert len(results[0]) == 2 * 2 * kv_cases * 2 * 4  # layouts × causal × kv heads × dtypes × (out, dq, dk, dv)
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


# ---- training equivalence ----------------------------------------------------------------------------
def _step(model, opt, logits_fn, batch, group=None):
    logits = logits_fn(model, batch)
    loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())
    opt.zero_grad()
    loss.backward()
    loss = loss.detach().clone()
    if group is not None:
        for p in model.parameters():  # as FSDP over dp_shard×cp does: average the gradients over the cp ranks
            dist.all_reduce(p.grad, op=dist.ReduceOp.AVG, group=group)
        dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=group)
    opt.step()
    return loss.item()


def _train(make_model, logits_fn, attention):
    from meshkit.models.llama import synthetic_tokens
    from meshkit.plugins.context_parallel import apply_context_parallel, shard_batch

    mesh = _cp_mesh(4)
    torch.manual_seed(0)
    ref_model, cp_model = make_model(), make_model()
    cp_model.load_state_dict(ref_model.state_dict())
    apply_context_parallel(cp_model, mesh, attention=attention)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-2)
    cp_opt = torch.optim.AdamW(cp_model.parameters(), lr=1e-2)
    data = synthetic_tokens(2 * STEPS, SEQ, 256, seed=1)
    ref_losses, cp_losses = [], []
    for step in range(STEPS):
        tokens = data[2 * step : 2 * step + 2]  # (B=2, T+1)
        full = {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:], "positions": torch.arange(SEQ).expand(2, -1)}
        ref_losses.append(_step(ref_model, ref_opt, logits_fn, full))
        cp_losses.append(_step(cp_model, cp_opt, logits_fn, shard_batch(tokens, mesh), mesh.get_group()))
    return ref_losses, cp_losses, cp_model


def _demo_model():
    from meshkit.models.llama import LlamaConfig, Transformer

    return Transformer(LlamaConfig.tiny(n_layers=2))


def _demo_logits(model, batch):
    return model(batch["input_ids"], batch["positions"])


def _body_demo(rank, world_size, attention):
    from meshkit.models.llama import LlamaConfig, LlamaLM, synthetic_tokens
    from meshkit.plugins.context_parallel import apply_context_parallel, gather_sequence, shard_batch

    ref, got, _ = _train(_demo_model, _demo_logits, attention)
    # A LightningModule calling its Transformer without positions: the inner model gets the global ones.
    torch.manual_seed(0)
    lm = LlamaLM(LlamaConfig.tiny(n_layers=2))
    tokens = synthetic_tokens(2, SEQ, 256, seed=2)
    want = lm(tokens[:, :-1])
    apply_context_parallel(lm, _cp_mesh(4), attention=attention)
    logits = gather_sequence(lm(shard_batch(tokens, _cp_mesh(4))["input_ids"]), _cp_mesh(4))
    return ref, got, (logits - want).abs().max().item()


@pytest.mark.parametrize("attention", ["ring", "allgather", "ulysses"])
def test_demo_transformer_cp4_trains_like_one_process(pool, attention):
    for ref, got, lm_logits_err in pool.run(_body_demo, attention):
        assert ref[-1] < ref[0]  # it learns: the comparison is over moving weights
        torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=1e-4, atol=0)
        assert lm_logits_err < 1e-5


def _hf_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, attn_implementation="sdpa", use_cache=False,
    )  # fmt: skip
    return LlamaForCausalLM(cfg)


def _hf_logits(model, batch):
    return model(input_ids=batch["input_ids"], position_ids=batch["positions"]).logits


def _body_hf(rank, world_size, attention):
    ref, got, model = _train(_hf_model, _hf_logits, attention)
    return ref, got, model.config._attn_implementation


@pytest.mark.parametrize("attention", ["ring", "ulysses"])
def test_transformers_llama_cp4_trains_like_one_process(pool, attention):
    for ref, got, impl in pool.run(_body_hf, attention):
        assert impl.startswith(f"meshkit_cp_{attention}")
        assert ref[-1] < ref[0]
        torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=1e-4, atol=0)


def _body_shard_batch(rank, world_size):
    from meshkit.plugins.context_parallel import gather_sequence, shard_batch

    mesh = _cp_mesh(4)
    tokens = torch.arange(17).expand(2, -1)  # T+1 = 17: inputs 0..15, labels 1..16
    lb = shard_batch(tokens, mesh)
    flat = shard_batch({"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]}, mesh, layout="contiguous")
    with pytest.raises(ValueError, match=r"`input_ids.shape\[1\]=12` must be divisible by 2·cp=8"):
        shard_batch(torch.zeros(2, 13, dtype=torch.long), mesh)
    back = gather_sequence(lb["labels"], mesh)
    firsts = (lb["input_ids"][0], lb["labels"][0], lb["positions"][1], flat["positions"][0])
    return *(t.tolist() for t in firsts), back


def test_shard_batch_layouts(pool):
    results = pool.run(_body_shard_batch)
    # 16 tokens, 8 chunks of 2: rank r holds chunks r and 7-r.
    expected_lb = [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]]
    for rank, (inputs, labels, positions, flat_positions, back) in enumerate(results):
        assert inputs == expected_lb[rank]
        assert positions == expected_lb[rank]
        assert labels == [t + 1 for t in expected_lb[rank]]
        assert flat_positions == list(range(4 * rank, 4 * rank + 4))
        assert torch.equal(back, torch.arange(1, 17).expand(2, -1))


# ---- Lightning: NDParallelStrategy with cp ------------------------------------------------------------
def _fit(rank: int, world: int, strategy: Any, devices: int, num_nodes: int) -> dict:
    import meshkit

    if isinstance(strategy, dict):
        strategy = meshkit.NDParallelStrategy(**strategy)
    return T.fit(rank, world, strategy, devices=devices, num_nodes=num_nodes, steps=FIT_STEPS, kind="meshkit")


# (id, strategy, devices per node, nodes, expected degrees, a parameter's (mesh axes, placements))
CASES = [
    ("cp_ring", "cp", 4, 1, dict(dp_replicate=1, dp_shard=1, cp=4, tp=1), (("dp_shard_cp",), ("S(0)",))),
    ("cp_ulysses", {"preset": "cp", "cp_attention": "ulysses"}, 4, 1, dict(dp_shard=1, cp=4, tp=1),
     (("dp_shard_cp",), ("S(0)",))),
    ("hsdp_cp_allgather", {"preset": "hsdp_cp", "cp_attention": "allgather"}, 2, 2,
     dict(dp_replicate=2, dp_shard=1, cp=2, tp=1), (("dp_replicate", "dp_shard_cp"), ("R", "S(0)"))),
    ("hsdp_tp_cp", "hsdp_tp_cp", 4, 1, dict(dp_replicate=1, dp_shard=1, cp=2, tp=2),
     (("dp_shard_cp", "tp"), ("_S(0, 2)", "S(0)"))),
]  # fmt: skip


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_cp_preset_matches_one_process(pool, case):
    _, strategy, devices, nodes, degrees, placement = case
    results = pool.run(_fit, strategy, devices, nodes)
    for key, value in degrees.items():
        assert results[0]["degrees"][key] == value, (key, results[0]["degrees"])
    losses = T.global_losses(results)  # also checks that the cp ranks of a dp group report the same loss
    want_losses, want_params = T.reference("meshkit", FIT_STEPS, results[0]["dp_size"])
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses), rtol=1e-4, atol=0)
    T.assert_params_close(results[0]["params"], want_params)
    axes, places = results[0]["placements"]["model.layers.0.attention.wq.weight"]
    assert (axes, tuple(p.replace("Replicate()", "R") for p in places)) == placement


def test_cp_presets_resolve_and_validate():
    import meshkit
    from meshkit.models.llama import LlamaConfig, LlamaLM
    from meshkit.plugins.presets import PRESETS, resolve_dims, resolve_layout

    auto = dict.fromkeys(("dp_replicate", "dp_shard", "pp", "cp", "tp"), "auto")
    # 2 nodes of 4: cp takes 2 of a node, tp the other 2, HSDP replicates across the nodes.
    assert resolve_dims(PRESETS["hsdp_tp_cp"], auto, world_size=8, num_nodes=2).degrees == dict(
        dp_replicate=2, dp_shard=1, pp=1, cp=2, tp=2
    )
    assert resolve_dims(PRESETS["cp"], auto, world_size=8, num_nodes=2).degrees == dict(
        dp_replicate=1, dp_shard=2, pp=1, cp=4, tp=1
    )
    with pytest.raises(ValueError, match=r"`cp_attention='tree'` must be one of"):
        meshkit.NDParallelStrategy("cp", cp_attention="tree")
    model = LlamaLM(LlamaConfig.tiny(dim=48, n_heads=6, n_kv_heads=6))
    config = meshkit.ParallelConfig(cp_attention="ulysses")
    with pytest.raises(ValueError, match=r"`cp_attention='ulysses'` with `cp=4` and `tp=1` needs the heads per TP rank \(6\)"):
        resolve_layout(PRESETS["cp"], auto, config, world_size=4, num_nodes=1, model=model)


def _hf_cp_module() -> Any:
    """transformers' Llama in a LightningModule that reads the dict batches cp hands it."""

    class HFLlamaCP(T.HFLlamaLM):
        def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
            logits = self.model(input_ids=batch["input_ids"], position_ids=batch["positions"]).logits
            return F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten())

    torch.manual_seed(0)  # as T.build_module("hf"): same initial weights as the reference
    return HFLlamaCP(lr=0.5)


def _fit_hf(rank: int, world: int, attention: str) -> dict:
    import lightning as L
    from torch.utils.data import DataLoader

    import meshkit

    T.launcher_env(rank, 4)
    module = _hf_cp_module()
    recorder = T.LossRecorder()
    trainer = L.Trainer(
        accelerator="cpu", devices=4, strategy=meshkit.NDParallelStrategy("cp", cp_attention=attention),
        max_steps=FIT_STEPS, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[recorder],
    )  # fmt: skip
    trainer.fit(module, DataLoader(T.tokens(FIT_STEPS * T.PER_RANK_BATCH * world), batch_size=T.PER_RANK_BATCH))
    return {"losses": recorder.losses, "dp_rank": 0, "params": T.full_params(module),
            "impl": module.model.config._attn_implementation}  # fmt: skip


def test_cp_transformers_llama_lightning_matches_one_process(pool):
    results = pool.run(_fit_hf, "ring")
    assert results[0]["impl"].startswith("meshkit_cp_ring")
    want_losses, want_params = T.reference("hf", FIT_STEPS, 1)
    torch.testing.assert_close(torch.tensor(T.global_losses(results)), torch.tensor(want_losses), rtol=1e-4, atol=0)
    T.assert_params_close(results[0]["params"], want_params)


# ---- cp with ignored labels: the token-weighted mean (meshkit.loss) -----------------------------------------
MASKED_STEPS = 3


def _masked(tokens: torch.Tensor) -> list[dict]:
    """(N, T+1) tokens as {"input_ids", "labels"} rows whose labels 4..9 are ignored (-100). Under cp=2
    (load balanced, 4 chunks of 4) cp rank 0 holds positions 0-3 and 12-15, rank 1 4-11: rank 0 keeps 8
    valid targets per row, rank 1 2. Every row keeps 10, so each dp replica's batch holds 20."""
    labels = tokens[:, 1:].clone()
    labels[:, 4:10] = -100
    return [{"input_ids": t[:-1], "labels": y} for t, y in zip(tokens, labels)]


def _masked_reference(world: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process on each step's global batch: the plain mean over its valid targets."""
    from torch.utils.data import default_collate

    module = T.build_module("meshkit")
    opt = module.configure_optimizers()
    rows = _masked(T.tokens(MASKED_STEPS * T.PER_RANK_BATCH * world))
    losses = []
    for idx in T.step_batches(len(rows), 2, MASKED_STEPS):
        batch = default_collate([rows[i] for i in idx.tolist()])
        logits = module(batch["input_ids"])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten(), ignore_index=-100)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in module.named_parameters()}


def _fit_masked(rank: int, world: int) -> dict:
    import warnings

    import lightning as L
    from torch.utils.data import DataLoader, default_collate

    import meshkit
    from meshkit.loss import num_items
    from meshkit.plugins.context_parallel import per_rank_mean_warning, shard_batch

    T.launcher_env(rank, 4)
    module = T.build_module("meshkit")  # LlamaLM: meshkit.loss.cross_entropy on the cp batch's labels
    recorder = T.LossRecorder()
    trainer = L.Trainer(
        accelerator="cpu", devices=4, strategy=meshkit.NDParallelStrategy("cp", dp_shard=2, cp=2, tp=1),
        max_steps=MASKED_STEPS, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[recorder],
    )  # fmt: skip
    rows = _masked(T.tokens(MASKED_STEPS * T.PER_RANK_BATCH * world))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, DataLoader(rows, batch_size=T.PER_RANK_BATCH))
    # A hand-written per-rank mean is what the strategy warns about (on cp rank 0); a loss that divided by
    # the group's count (meshkit.loss.num_items) silences it.
    batch = shard_batch(default_collate(rows[:2]), trainer.strategy.parallel_dims.submesh("cp"))
    from meshkit.plugins.context_parallel import layout

    layout._CHECKED[0] = 0  # this pool process's earlier fits may have used up the checked batches
    hand = per_rank_mean_warning(batch)
    num_items(batch["labels"])
    return {"losses": recorder.losses, "dp_rank": trainer.strategy.parallel_dims.submesh("dp").get_local_rank(),
            "params": T.full_params(module), "counts": batch.target_counts.tolist(), "cp_rank": batch.cp_rank,
            "hand": hand,
            "after_num_items": per_rank_mean_warning(batch),
            "warned": [str(w.message) for w in caught if "valid (non -100) targets" in str(w.message)]}


def test_cp_ignored_labels_match_one_process(pool):
    """cp=2 × dp_shard=2, the cp ranks holding 16 and 4 valid targets of every batch: LlamaLM's loss
    (meshkit.loss.cross_entropy) gives one process's losses and final parameters (every name). A per-rank
    mean would weight rank 1's tokens 4x rank 0's."""
    results = pool.run(_fit_masked)
    want_losses, want_params = _masked_reference(4)
    torch.testing.assert_close(torch.tensor(T.global_losses(results)), torch.tensor(want_losses), rtol=1e-4, atol=0)
    T.assert_params_close(results[0]["params"], want_params)
    for r in results:
        assert r["counts"] == [16, 4] and r["warned"] == [] and r["after_num_items"] is None
        if r["cp_rank"] == 0:
            assert "the cp ranks hold [16, 4] valid (non -100) targets" in r["hand"]
            assert "meshkit.loss.cross_entropy(logits, batch['labels'])" in r["hand"]
        else:
            assert r["hand"] is None
