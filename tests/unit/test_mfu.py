"""MFUMonitor's pure parts: mesh factors, token counting, the step split, MFU points lost, report layer."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from meshkit.profiling import report as R
from meshkit.profiling.mfu import MFUMonitor, _Window, batch_tokens, mesh_factors, sequence_shards, split_step


class _Dims:
    def __init__(self, **degrees):
        self.degrees = {"dp_replicate": 1, "dp_shard": 1, "pp": 1, "cp": 1, "tp": 1, **degrees}


class _Strategy:
    def __init__(self, dims=None):
        if dims is not None:
            self.parallel_dims = dims


def test_mesh_factors_count_tokens_once_per_dp_replica():
    # 8 ranks: 2 replicas x 2 shards x tp 2 -> 4 dp replicas; tp ranks share a replica's tokens
    assert mesh_factors(_Strategy(_Dims(dp_replicate=2, dp_shard=2, tp=2)), 8) == (4, 8)
    assert mesh_factors(_Strategy(_Dims(dp_shard=2, pp=2, cp=2)), 8) == (2, 8)
    assert mesh_factors(_Strategy(), 4) == (4, 4)  # plain DDP fallback
    with pytest.raises(ValueError, match=r"multiply to 4, not the world size \(8\)"):
        mesh_factors(_Strategy(_Dims(dp_shard=2, tp=2)), 8)
    # a cp rank's batch is T/cp of each sequence: local tokens and T are multiplied by cp
    assert sequence_shards(_Strategy(_Dims(dp_shard=2, pp=2, cp=2))) == 2
    assert sequence_shards(_Strategy(_Dims(tp=2))) == 1 and sequence_shards(_Strategy()) == 1


def test_batch_tokens():
    assert batch_tokens(torch.zeros(2, 17)) == 34
    assert batch_tokens({"input_ids": torch.zeros(2, 16), "labels": torch.zeros(2, 16)}) == 32
    assert batch_tokens((torch.zeros(3, 5), torch.zeros(3))) == 15
    with pytest.raises(ValueError, match=r"tokens_fn="):
        batch_tokens("text")


def test_split_step_by_hand():
    zero = dict.fromkeys(R.BREAKDOWN_PARTS, 0.0)
    # no window yet: fwd+bwd is all compute
    f = split_step(100, data_ms=10, fwd_bwd_ms=70, optimizer_ms=20, window=None, recompute_share=0.0)
    assert f == pytest.approx(zero | {"compute": 0.7, "data_wait": 0.1, "optimizer": 0.2})
    # window measured at fwd+bwd 35 ms: exposed 5 ms and bubble 2.5 ms carry in ms (waits are not slowed by the
    # profiler), host idle 1 ms of 35 carries as a share: 2 ms of this step's 70 ms; the remaining
    # 70 - 9.5 = 60.5 ms of compute: 20 % recompute (12.1) and 48.4 compute.
    w = _Window(step=3, fwd_bwd_ms=35, exposed_ms=5, bubble_ms=2.5, other_ms=1)
    f = split_step(100, 10, 70, 20, w, recompute_share=0.2)
    assert f == pytest.approx(zero | {"compute": 0.484, "recompute": 0.121, "exposed_comm": 0.05, "bubble": 0.025,
                                      "data_wait": 0.1, "optimizer": 0.2, "other": 0.02})
    assert sum(f.values()) == pytest.approx(1.0)
    # waits longer than this step's fwd+bwd are clipped to it, in precedence order; nothing goes negative
    f = split_step(20, 5, 10, 5, _Window(0, 10, 8, 4, 0), 0.0)
    assert f["compute"] == 0 and f["exposed_comm"] == pytest.approx(8 / 20) and f["bubble"] == pytest.approx(2 / 20)
    assert min(f.values()) >= 0 and sum(f.values()) == pytest.approx(1.0)
    # the gap before the batch: validation, checkpoint and the monitor's own profiler work are not data wait
    f = split_step(400, 10, 70, 20, None, 0.0, validation_ms=150, checkpoint_ms=100, profiler_ms=50)
    assert f == pytest.approx(zero | {"compute": 0.175, "data_wait": 0.025, "optimizer": 0.05, "validation": 0.375,
                                      "checkpoint": 0.25, "profiler_overhead": 0.125})


def test_points_lost_add_up_to_achieved_mfu():
    fr = {"compute": 0.5, "recompute": 0.1, "exposed_comm": 0.2, "bubble": 0.0, "data_wait": 0.05,
          "optimizer": 0.1, "other": 0.05}
    lost = R.points_lost(fr, mfu=0.2)
    assert lost["ideal"] == pytest.approx(40.0)  # 0.2 / 0.5
    assert lost["exposed_comm"] == pytest.approx(8.0)  # 40 x 0.2
    assert lost["ideal"] - sum(v for k, v in lost.items() if k != "ideal") == pytest.approx(20.0)


def test_report_layer(tmp_path):
    fr = dict.fromkeys(R.BREAKDOWN_PARTS, 0.0) | {"compute": 0.8, "other": 0.2}
    assert R.points_lost(dict(fr, compute=0.0), mfu=0.0)["other"] == 0.0  # no compute: no ideal, no 1e17 losses
    table = R.markdown_table(fr, mfu=0.4, step_time_s=0.5)
    assert "| exposed_comm | 0.00 % | 0.00 | 0.000 |" in table and "**40.00 %**" in table
    assert "| other | 20.00 % | 10.00 | 100.000 |" in table  # ideal 50 % x 0.2 ; 0.5 s x 0.2
    pts = R.waterfall(fr, {"matmul": 0.75, "attention": 0.0}, {"matmul": 0.4})
    img = R.waterfall_image(pts)
    assert img.ndim == 3 and img.shape[2] == 3 and img.dtype == np.uint8
    layout = R.breakdown_layout()
    assert list(layout) == [R.LAYOUT_TITLE]
    charts = layout[R.LAYOUT_TITLE]
    # one series per chart (a chart's lines share the run's colour), every bucket has its own chart
    assert all(len(tags) == 1 for _, tags in charts.values())
    assert {tags[0] for _, tags in charts.values()} >= {R.breakdown_tag(p) for p in R.BREAKDOWN_PARTS} | {R.MFU_TAG}

    class Writer:
        def __init__(self):
            self.calls, self.scalars, self.text = [], {}, ""

        def add_scalar(self, tag, value, step):
            self.calls.append("add_scalar")
            self.scalars[tag] = (value, step)

        def add_text(self, tag, text, step):
            self.calls.append("add_text")
            self.text = text

        def __getattr__(self, name):
            return lambda *a, **k: self.calls.append(name)

    w = Writer()
    R.write_window(w, 7, fr, 0.4, 0.5, overlap={"ranks": {}, "stragglers": []}, points=pts,
                   exposed_comm_by_axis_ms={"tp": 1.5})
    assert w.calls[:2] == ["add_text", "add_image"]
    # compute 80 % of the step: 60 points in matmuls delivering 40, 20 in other kernels; host_other 20
    want = {"peak": 100.0, "host_other": 20.0, "non_matmul": 20.0, "matmul_efficiency": 20.0, "achieved": 40.0}
    for p in ("peak", *R.WATERFALL_PARTS, "achieved"):
        assert w.scalars[f"MFU_waterfall_points/{p}"] == (pytest.approx(want.get(p, 0.0)), 7), p
    assert w.scalars["MFU_exposed_comm_ms/tp"] == (1.5, 7)
    assert "| matmul_efficiency | 20.00 | larger tile-aligned matmuls" in w.text


def test_step_scalars_are_percent_under_the_first_screen_groups():
    fr = dict.fromkeys(R.BREAKDOWN_PARTS, 0.0) | {"compute": 0.5, "exposed_comm": 0.25, "data_wait": 0.25}
    s = R.step_scalars(0.1, 0.12, fr, step_time_s=0.2, tflops_per_device=1.0, hardware_tflops_per_device=1.2,
                       tokens_per_s=100.0, tokens_per_s_per_device=50.0)
    assert s[R.MFU_TAG] == pytest.approx(10.0) and s[R.HFU_TAG] == pytest.approx(12.0)
    assert sum(s[R.breakdown_tag(p)] for p in R.BREAKDOWN_PARTS) == pytest.approx(100.0)
    assert s[R.breakdown_tag("exposed_comm")] == pytest.approx(25.0)
    assert s[R.points_lost_tag("exposed_comm")] == pytest.approx(5.0)  # ideal 20 % x 0.25
    assert s["MFU_details/step_time_ms"] == pytest.approx(200.0)
    # TensorBoard's TIME SERIES expands the first two tag groups, sorted by character code ("/" first):
    # the headline groups are upper case, so they come before Lightning's epoch / hp_metric / train_loss
    groups = sorted({t.split("/", 1)[0] for t in s} | {"epoch", "hp_metric", "train_loss"})
    assert groups[:2] == [R.HEADLINE_GROUP, R.BREAKDOWN_GROUP]
    assert R.WATERFALL_TAG.split("/")[0] == R.HEADLINE_GROUP


def test_wide_tables_are_preformatted_text():
    out = R.overlap_markdown({"ranks": {0: dict(steps=2, compute_ms=1.0, comm_ms=2.0, overlapped_comm_ms=1.0,
                                                 exposed_comm_ms=1.0, idle_ms=0.5, overlap_pct=50.0)}})
    lines = out.splitlines()
    block = lines[lines.index("```") + 1:]
    block = block[:block.index("```")]
    assert block[0].split() == ["rank", "steps", "compute_ms", "comm_ms", "overlapped_comm_ms", "exposed_comm_ms",
                                "idle_ms", "overlap_pct"]
    assert block[2].split() == ["0", "2", "1.000", "2.000", "1.000", "1.000", "0.500", "50.000"]
    assert len({len(line) for line in block}) == 1  # padded columns


@pytest.mark.parametrize("kwargs, match", [
    (dict(profile_steps=0), r"profile_steps=0"), (dict(profile_every=-1), r"profile_every=-1"),
    (dict(log_every=0), r"log_every=0"), (dict(peak_flops=-5), r"peak_flops=-5"),
    (dict(profile_budget=0), r"profile_budget=0"), (dict(profile_budget=1.5), r"profile_budget=1.5"),
])
def test_monitor_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MFUMonitor(**kwargs)


def test_deferred_clock_reads_each_step_one_step_late(monkeypatch, tmp_path):
    """A GPU clock is read one step late (no per-step sync). With a clock that defers on CPU, each
    batch end has recorded every step but the newest, train end records the last one, and the
    steps and their phase times equal what the clocks hold."""
    import lightning as L
    from lightning.pytorch.callbacks import Callback

    from meshkit.models import LlamaConfig, LlamaLM, synthetic_tokens
    from meshkit.profiling import mfu as M

    clocks = []

    class DeferredClock(M._Clock):
        def __init__(self, device):
            super().__init__(device)
            self.deferred = True
            clocks.append(self)

    class Seen(Callback):  # runs after the monitor: what it has recorded at each batch end
        def __init__(self):
            self.recorded = []

        def on_train_batch_end(self, trainer, *args):
            self.recorded.append([m.step for m in mon.history])

    monkeypatch.setattr(M, "_Clock", DeferredClock)
    mon, seen = MFUMonitor(profile_every=0, measure_flops=False, peak_flops=1e12, log_every=1), Seen()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=6, logger=False, default_root_dir=str(tmp_path),
                        callbacks=[mon, seen], enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(LlamaLM(LlamaConfig.tiny()), torch.utils.data.DataLoader(synthetic_tokens(12, 16, 256), batch_size=2))
    assert seen.recorded == [[], [0], [0, 1], [0, 1, 2], [0, 1, 2, 3], [0, 1, 2, 3, 4]]
    assert [m.step for m in mon.history] == [0, 1, 2, 3, 4, 5]  # the last at train end
    for m, clock in zip(mon.history, clocks):
        fb, opt = clock.phases_ms()
        assert fb > 0 and opt > 0 and m.step_time_s >= (fb + opt) / 1e3


def test_carried_window_leaves_the_stop_signal_wait_to_each_batch():
    """A profiled batch of 1000 ms: 100 data wait, 300 waiting in the stop-signal broadcast (timed, exposed
    comm), forward+backward 500 of which 200 exposed comm and 100 host idle, optimizer 100. Later batches
    take from the window what was inside forward+backward: exposed 200 ms (not 500: each batch times its
    own stop-signal wait), host idle 100 of a 500 ms forward+backward."""
    from meshkit.profiling.mfu import StepMetrics, _Window, split_step

    mon = MFUMonitor(profile_every=0)
    window = _Window(7, 500.0, 200.0, 0.0, 100.0)
    parts = split_step(1000.0, 100.0, 500.0, 100.0, window, 0.0, stop_signal_ms=300.0)
    assert parts["exposed_comm"] == pytest.approx(0.5) and parts["compute"] == pytest.approx(0.2)
    mon.history.append(StepMetrics(7, 1.0, 0.1, 0.1, 1.0, 1.0, 1.0, 1.0, parts))
    mon._in_window, mon._window_stop_ms = {7: {}}, {7: 300.0}
    carried = mon._carried_window()
    assert (carried.fwd_bwd_ms, carried.exposed_ms, carried.other_ms) == pytest.approx((500.0, 200.0, 100.0))
