"""Exposed communication per mesh axis against injected truth: 4 gloo ranks, the tiny demo model.

A tp-only run (tp=4: every collective is tensor parallel, FSDP has one rank) must put >= 90 % of each
rank's exposed communication on ``tp``, an FSDP-only run (dp_shard=4) >= 90 % on ``dp_shard``; the axes
sum to ``exposed_comm_ms`` within 5 %; and every rank's MFU waterfall sums, on one peak.
"""

from __future__ import annotations

from datetime import timedelta

import pytest

from tests.dist_pool import ProcessPool

SEQ, BATCH, STEPS = 16, 2, 5


@pytest.fixture(scope="module")
def pool():
    with ProcessPool(world_size=4, timeout=600) as p:
        yield p


def _run(rank, world_size, root, tp, dp_shard):
    import lightning as L
    import torch

    import meshkit
    from meshkit.models import LlamaConfig, LlamaLM, synthetic_tokens
    from meshkit.profiling.mfu import MFUMonitor

    torch.manual_seed(0)
    loader = torch.utils.data.DataLoader(synthetic_tokens(world_size * BATCH * STEPS, SEQ, 256), batch_size=BATCH)
    mon = MFUMonitor(profile_every=100, profile_start=2, profile_steps=2, profile_budget=None, log_every=1,
                     measure_flops=False)
    strategy = meshkit.NDParallelStrategy(dp_replicate=1, dp_shard=dp_shard, tp=tp, pp=1, cp=1,
                                          timeout=timedelta(seconds=120))
    trainer = L.Trainer(accelerator="cpu", devices=world_size, strategy=strategy, max_steps=STEPS, logger=False,
                        default_root_dir=root, callbacks=[mon], enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(LlamaLM(LlamaConfig.tiny(n_layers=2, n_kv_heads=4), lr=1e-3), loader)
    return mon.trace_dir


@pytest.mark.parametrize("axis, tp, dp_shard", [("tp", 4, 1), ("dp_shard", 1, 4)])
def test_exposed_comm_lands_on_its_axis(pool, tmp_path, axis, tp, dp_shard):
    from meshkit.profiling.overlap import analyze

    trace_dir = pool.run(_run, str(tmp_path), tp, dp_shard)[0]
    res = analyze(trace_dir)
    assert sorted(res["ranks"]) == ["0", "1", "2", "3"], res["problems"]
    table = {}
    for r, v in res["ranks"].items():
        by_axis = v["exposed_comm_by_axis_ms"]
        assert set(by_axis) >= {"dp_replicate", "dp_shard", "pp", "cp", "tp"}, by_axis
        assert v["exposed_comm_ms"] > 0
        assert sum(by_axis.values()) == pytest.approx(v["exposed_comm_ms"], rel=0.05)
        assert by_axis[axis] >= 0.9 * v["exposed_comm_ms"], (r, by_axis, v["exposed_comm_ms"])
        w = v["waterfall"]
        assert v["peak_flops"] == res["peak_flops"] and 100 - sum(p["points"] for p in w[1:-1]) == pytest.approx(
            w[-1]["points"], abs=1e-4)
        table[r] = {k: round(x, 3) for k, x in by_axis.items()}
    print(f"\n{axis}-only run, exposed comm by axis (ms):", table)
