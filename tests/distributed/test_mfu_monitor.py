"""MFUMonitor in a real 4-rank gloo DDP run: breakdown sums to 1, FLOPs match a single-process
reference, MFU matches the formula by hand, and `analyze` reads the traces it wrote."""

from __future__ import annotations

import math

import pytest

from tests.dist_pool import ProcessPool

SEQ, BATCH, STEPS = 16, 2, 6


@pytest.fixture(scope="module")
def pool():
    with ProcessPool(world_size=4, timeout=900) as p:
        yield p


def _train(rank, world_size, root):
    import lightning as L
    import torch
    from lightning.pytorch.loggers import TensorBoardLogger

    from meshkit.models import LlamaConfig, LlamaLM, Transformer, synthetic_tokens
    from meshkit.profiling.flops import measure_step_flops
    from meshkit.profiling.mfu import MFUMonitor

    torch.manual_seed(0)
    data = synthetic_tokens(world_size * BATCH * STEPS, SEQ, 256)  # (N, SEQ + 1)
    loader = torch.utils.data.DataLoader(data, batch_size=BATCH)
    mon = MFUMonitor(profile_every=3, profile_start=2, profile_steps=1, log_every=1)
    trainer = L.Trainer(accelerator="cpu", devices=world_size, strategy="ddp", max_steps=STEPS,
                        logger=TensorBoardLogger(root, name="run"), callbacks=[mon], enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(LlamaLM(LlamaConfig.tiny()), loader)
    # single-process reference: one rank's step is the tiny Transformer on (BATCH, SEQ) tokens
    ref = measure_step_flops(Transformer(LlamaConfig.tiny()), torch.zeros(BATCH, SEQ, dtype=torch.long))
    return {
        "history": [(m.step, m.step_time_s, m.mfu, m.hfu, m.tokens_per_s, dict(m.breakdown)) for m in mon.history],
        "measured": mon.measured_flops, "peak": mon._peak, "trace_dir": mon.trace_dir,
        "windows": len(mon.windows), "ref_forward": ref.forward, "ref_hardware": ref.hardware,
    }


def test_mfu_monitor_ddp_gloo(pool, tmp_path):
    from meshkit.models import LlamaConfig
    from meshkit.profiling.flops import model_flops_per_token
    from meshkit.profiling.overlap import analyze

    results = pool.run(_train, str(tmp_path))
    for r in results:
        assert r["windows"] >= 1
        assert len(r["history"]) >= STEPS - 2  # every step but the FLOP-counted one (and step 0's start)
        for _, _, mfu, hfu, _, parts in r["history"]:
            assert all(v >= 0 for v in parts.values()), parts
            assert sum(parts.values()) == pytest.approx(1.0, abs=0.01)
            assert 0 < mfu <= hfu
        # FLOPs summed over 4 ranks == 4 x a single-process FlopCounterMode run of one rank's step
        assert r["measured"]["forward"] == 4 * r["ref_forward"]
        assert r["measured"]["hardware"] == 4 * r["ref_hardware"]
        assert r["measured"]["tokens"] == 4 * BATCH * SEQ  # once per dp replica; plain DDP: 4; no label column
    # MFU by hand on rank 0: global tokens · 6N+12LHQT / (step time · world · peak), T without the label shift
    r0 = results[0]
    fpt = model_flops_per_token(LlamaConfig.tiny(), seq_len=SEQ)
    tokens = 4 * BATCH * SEQ
    for _, t, mfu, _, tps, _ in r0["history"]:
        assert mfu == pytest.approx(tokens * fpt / (t * 4 * r0["peak"]), rel=1e-9)
        assert tps == pytest.approx(tokens / t, rel=1e-9)
    assert len({r["peak"] for r in results}) == 1  # one peak per run: rank 0 calibrates, every rank takes it
    res = analyze(r0["trace_dir"])
    assert sorted(res["ranks"]) == ["0", "1", "2", "3"] and not res["partial"], res["problems"]
    assert res["peak_flops"] == r0["peak"] and "shared with all 4 ranks" in res["peak_source"]
    for v in res["ranks"].values():
        assert v["steps"] >= 1 and v["compute_ms"] > 0 and v["comm_ms"] > 0  # DDP's gloo all_reduce
        assert 0 <= v["overlap_pct"] <= 100
        # the waterfall: from 100 to the MFU of the profiled steps, by hand: model FLOPs per device per step
        # (global tokens x 6N+12LHQT / 4 ranks) x steps / (peak x their wall time)
        w = v["waterfall"]
        assert v["peak_flops"] == r0["peak"] and w[0] == {"part": "peak", "points": 100.0}
        mfu = 100 * v["steps"] * tokens * fpt / 4 / (r0["peak"] * v["wall_ms"] / 1e3)
        assert w[-1]["part"] == "achieved" and w[-1]["points"] == pytest.approx(mfu, rel=1e-5, abs=1e-6)
        assert 100 - sum(p["points"] for p in w[1:-1]) == pytest.approx(w[-1]["points"], abs=1e-4)
        assert all(p["points"] >= 0 for p in w[1:-3]), w  # time parts and non_matmul
        assert sum(v["host_other_split"].values()) == pytest.approx(dict((p["part"], p["points"]) for p in w)[
            "host_other"], abs=1e-4)
        # plain DDP: no mesh, the world group is dp_replicate; its gloo all-reduces are all there is
        axes = v["exposed_comm_by_axis_ms"]
        assert list(axes) == ["dp_replicate", "dp_shard", "pp", "cp", "tp"], axes
        assert axes["dp_replicate"] == pytest.approx(v["exposed_comm_ms"], rel=0.05) and sum(axes.values()) == \
            pytest.approx(v["exposed_comm_ms"], rel=0.05), v


def _windows(rank, world_size, root, budget):
    import lightning as L
    import torch

    from meshkit.models import LlamaConfig, LlamaLM, synthetic_tokens
    from meshkit.profiling.mfu import MFUMonitor

    torch.manual_seed(0)
    loader = torch.utils.data.DataLoader(synthetic_tokens(world_size * BATCH * 16, SEQ, 256), batch_size=BATCH)
    mon = MFUMonitor(profile_every=2, profile_start=2, profile_steps=1, profile_budget=budget, log_every=4)
    trainer = L.Trainer(accelerator="cpu", devices=world_size, strategy="ddp", max_steps=16, logger=False,
                        default_root_dir=root, callbacks=[mon], enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(LlamaLM(LlamaConfig.tiny()), loader)
    return mon.profile_windows


@pytest.mark.parametrize("budget", [None, 0.01])
def test_profile_budget_spaces_windows_alike_on_every_rank(pool, tmp_path, budget):
    """Without a budget a window starts every 2 batches; with 1 % the measured cost (far above 1 % of
    these ~20 ms steps) pushes the next one past the run: windows start only when all of them together
    stay within the budget of the training time. Every rank agrees on every window."""
    results = pool.run(_windows, str(tmp_path), budget)
    assert all(r == results[0] for r in results)  # same batches, costs and gaps on all ranks
    windows = results[0]
    assert [w["batch"] for w in windows] == ([2, 4, 6, 8, 10, 12, 14] if budget is None else [2])
    spent = 0.0
    for w in windows:
        # back-to-back windows leave no plain step to compare with: their cost may measure 0
        assert w["step_s"] > 0 and (w["cost_s"] > 0 if budget else w["cost_s"] >= 0)
        spent += w["cost_s"]  # all windows so far and the next (costing about what this one did) within budget
        paid = w["batch"] + 2 if budget is None else max(w["batch"] + 2,
                                                         math.ceil((spent + w["cost_s"]) / (budget * w["step_s"])))
        assert w["next_batch"] == paid
    if budget is not None:
        assert windows[0]["next_batch"] > 16


def _flops(rank, world_size, root, layout):
    import lightning as L
    import torch

    import meshkit
    from meshkit.models import LlamaConfig, LlamaLM, Transformer, synthetic_tokens
    from meshkit.profiling.flops import measure_step_flops
    from meshkit.profiling.mfu import MFUMonitor

    torch.manual_seed(0)
    cfg = LlamaConfig.tiny(n_kv_heads=4)  # 4 kv heads: tp=4 divides them
    loader = torch.utils.data.DataLoader(synthetic_tokens(world_size * BATCH * 3, SEQ, 256), batch_size=BATCH)
    mon = MFUMonitor(profile_every=0, log_every=1)
    strategy = layout if isinstance(layout, str) else meshkit.NDParallelStrategy(**layout)
    trainer = L.Trainer(accelerator="cpu", devices=world_size, strategy=strategy, max_steps=3, logger=False,
                        default_root_dir=root, callbacks=[mon], enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(LlamaLM(cfg), loader)
    # one process, one replica's batch: (BATCH, SEQ) inputs, the whole model
    ref = measure_step_flops(Transformer(cfg), torch.zeros(BATCH, SEQ, dtype=torch.long))
    return {"measured": mon.measured_flops, "dp": mon._dp, "ref_forward": ref.forward, "ref_hardware": ref.hardware,
            "per_token": mon._model_per_token}


# dp_shard=2 x cp=2 (ring, load-balanced) and dp_shard=2 x pp=2 (1f1b, 2 micro-batches of 1) beside the presets
LAYOUTS = {"fsdp2": "fsdp2", "tp": "tp", "hsdp_tp": "hsdp_tp",
           "cp": {"dp_shard": 2, "cp": 2, "cp_attention": "ring", "cp_layout": "load_balanced"},
           "pp": {"dp_shard": 2, "pp": 2, "pp_microbatches": 2}}


def _cp_skipped_attention(cfg) -> tuple[float, float]:
    """(forward, forward + backward) FLOPs of one replica's causal attention that the cp=2 ring never runs.

    torch counts a causal SDPA call like a full one: one process counts 4·B·H·T²·hd per layer forward and
    2.5x that backward (flash recomputes the scores). The load-balanced ring cuts T into 2cp chunks of
    c = T/2cp, rank r holding chunks r and 2cp-1-r: step 0 is its local causal (2c)² block, counted in full;
    each of the cp-1 other kv shards needs only half of one side (c × 2c); fully masked blocks are
    skipped. Over the cp ranks: cp·(4c² + (cp-1)·2c²) = T²·(cp+1)/(2cp) of the T² one process counts,
    3/4 at cp=2 (tests/unit/test_flops_local.py checks the fraction against every plan and cp).
    """
    one_process = cfg.n_layers * 4 * BATCH * cfg.n_heads * SEQ * SEQ * cfg.head_dim
    skipped = one_process * (1 - 3 / 4)
    return skipped, 3.5 * skipped


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_flops_summed_over_ranks_equal_one_process(pool, tmp_path, name):
    """Each rank counts its local (sharded) work: the sum over the 4 ranks is the one-process count of
    the global batch (dp replicas x one batch), not tp times it (hsdp_tp counted 1.85x before). Under pp
    each stage counts its own layers over every micro-batch, and the forward is what ran outside backward
    (the schedule runs both inside training_step); under cp each rank its T/cp queries. Tokens and the
    analytic FLOPs per token are the one-process ones: cp ranks see T/cp of each sequence."""
    from meshkit.models import LlamaConfig
    from meshkit.profiling.flops import model_flops_per_token

    cfg = LlamaConfig.tiny(n_kv_heads=4)
    results = pool.run(_flops, str(tmp_path), LAYOUTS[name])
    skipped_fwd, skipped_hw = _cp_skipped_attention(cfg) if name == "cp" else (0.0, 0.0)
    for r in results:
        assert name not in ("cp", "pp") or r["dp"] == 2
        forward, hardware = r["dp"] * (r["ref_forward"] - skipped_fwd), r["dp"] * (r["ref_hardware"] - skipped_hw)
        assert r["measured"]["forward"] == pytest.approx(forward, rel=1e-9), (name, r)
        assert r["measured"]["hardware"] == pytest.approx(hardware, rel=1e-9), (name, r)
        assert r["measured"]["tokens"] == r["dp"] * BATCH * SEQ, (name, r)
        assert r["per_token"] == model_flops_per_token(cfg, seq_len=SEQ), (name, r)
        print(name, "dp", r["dp"], "summed over ranks: forward", r["measured"]["forward"], "hardware",
              r["measured"]["hardware"], "| one process x dp:", r["dp"] * r["ref_forward"], r["dp"] * r["ref_hardware"])
