"""meshkit.doctor's checks on hand-made numbers, records and traces (each expected value derived by hand),
the doctor.json round trip and `meshkit doctor`."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from meshkit.doctor import (RULES, Finding, diagnose_logdir, dp_overlap, few_microbatches, global_batch_changed,
                            identical_batches, low_occupancy, mfu_band, one_fsdp_unit, pp_unbalanced,
                            preset_fallback, previous_run, read_report, straggler, tp_across_nodes,
                            unused_parameters, write_report, zero3_exposed_allgather)
from meshkit.doctor.checks import axis_groups, rank_grid

ORDER = ("dp_replicate", "dp_shard", "pp", "cp", "tp")


def _degrees(**kw):
    return {a: kw.get(a, 1) for a in ORDER}


def test_tp_across_nodes_from_the_mesh_and_node_map():
    grid = rank_grid(_degrees(dp_shard=2, tp=4), ORDER)  # 8 ranks, tp groups [0..3], [4..7]
    assert axis_groups(grid, ORDER, ["tp"]) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    two_per_node = [r // 2 for r in range(8)]
    f = tp_across_nodes(grid, ORDER, two_per_node)
    assert f.id == "tp_across_nodes" and f.severity == "warning"
    assert f.evidence["tp"] == 4 and f.evidence["devices_per_node"] == 2
    assert f.evidence["groups_crossing"] == 2 and f.evidence["example_nodes"] == [0, 0, 1, 1]
    assert tp_across_nodes(grid, ORDER, [r // 4 for r in range(8)]) is None  # 4 per node: inside
    # tp outermost puts tp ranks 4 apart: crossing even with 4 devices per node
    order = ("tp", "dp_replicate", "dp_shard", "pp", "cp")
    f = tp_across_nodes(rank_grid(_degrees(dp_shard=4, tp=2), order), order, [r // 4 for r in range(8)])
    assert f.evidence["example_group"] == [0, 4]


def test_preset_fallback_hsdp_tp_on_three_devices():
    from meshkit.models import LlamaConfig, Transformer
    from meshkit.plugins.presets import PRESETS, resolve_dims

    auto, model = dict.fromkeys(ORDER, "auto"), Transformer(LlamaConfig.tiny())  # 4 heads, 2 kv heads
    dims = resolve_dims(PRESETS["hsdp_tp"], auto, world_size=3, num_nodes=1, model=model)
    assert dims.tp == 1  # what issue 18 saw: silently no tensor parallelism
    (f,) = preset_fallback(PRESETS["hsdp_tp"], dims.degrees, num_nodes=1, world_size=3)
    assert f.id == "preset_fallback" and f.evidence["axis"] == "tp" and f.evidence["devices_per_node"] == 3
    ok = resolve_dims(PRESETS["hsdp_tp"], auto, world_size=4, num_nodes=1, model=model)
    assert preset_fallback(PRESETS["hsdp_tp"], ok.degrees, num_nodes=1, world_size=4) == []


def test_one_fsdp_unit():
    f = one_fsdp_unit([161, 20], True)  # a flat MLP of 161 parameters beside a 20-parameter root
    assert f.id == "one_fsdp_unit"
    assert f.evidence == {"fsdp_units": 2, "largest_unit_share": 0.8895, "largest_unit_parameters": 161,
                          "parameters": 181}
    assert one_fsdp_unit([10, 10, 10, 5], True) is None and one_fsdp_unit([100], False) is None


def test_few_microbatches_m_below_4p():
    f = few_microbatches("1f1b", pp=4, microbatches=8)
    # 1F1B bubble (p-1)/(m+p-1): 3/11 at m=8, 3/19 at m=16
    assert f.evidence["needed"] == 16
    assert f.evidence["bubble"] == pytest.approx(3 / 11, abs=1e-4)
    assert f.evidence["bubble_at_4p"] == pytest.approx(3 / 19, abs=1e-4)
    assert few_microbatches("1f1b", pp=4, microbatches=16) is None
    assert few_microbatches("1f1b", pp=1, microbatches=1) is None


def test_dp_overlap_t_below_f_over_w():
    # F = 0.60 (the planner's calibrated achieved_fraction) x 989.4 TFLOP/s, W = 50 GB/s: F/W = 11873 tokens
    from meshkit.plugins.planner.costs import CALIBRATION

    assert CALIBRATION.achieved_fraction == 0.60
    f = dp_overlap(4096, 989.4e12, 50.0, dp=8, link="inter-node")
    assert f.id == "dp_overlap" and f.severity == "warning"
    assert f.evidence["needed_tokens"] == 11873 and f.evidence["tokens_per_dp_rank"] == 4096
    assert dp_overlap(16384, 989.4e12, 50.0, dp=8, link="inter-node") is None
    assert dp_overlap(1, 989.4e12, 50.0, dp=1, link="intra-node") is None
    assert dp_overlap(1, 1e11, 10.0, dp=2, link="intra-node", measured_peak=True).severity == "info"


@pytest.mark.parametrize("cp, accumulate, batch_shape, want_tokens", [
    (1, 1, (1, 33), 32),    # a (B, T+1) token tensor: 1 x 32 tokens < F/W = 60: a finding
    (2, 1, (1, 33), None),  # the replica's sequences: 32 x cp 2 = 64 >= 60 (a0427b2^ counted the shard: 32)
    (2, 3, (1, 9), 48),     # 8 tokens x 3 accumulated x cp 2 = 48 < 60 (a0427b2^: 24)
    (4, 1, (2, 8), None),   # {"input_ids"} of 2 x 8 per cp rank x cp 4 = 64 >= 60 (a0427b2^: 16)
])
def test_dp_overlap_counts_a_cp_replicas_whole_sequences(tmp_path, monkeypatch, cp, accumulate, batch_shape,
                                                         want_tokens):
    """The Doctor after its first step, on a fake trainer (one process; dp_shard=2 x cp on one node, fp32):
    F = 0.60 x 1e12 FLOP/s (MESHKIT_PEAK_FLOPS), W = 10 GB/s (the catalog's CPU row, intra-node), so
    F/W = 60 tokens. A cp rank's batch holds T/cp of each of its replica's sequences; the replica trains
    on all of them: tokens per dp rank = B x T_local x accumulate x cp."""
    import types

    import torch

    from meshkit.doctor import Doctor
    from meshkit.plugins.dims import ParallelDims

    monkeypatch.setenv("MESHKIT_PEAK_FLOPS", "1e12")
    strategy = types.SimpleNamespace(parallel_dims=ParallelDims(dp_shard=2, cp=cp, world_size=2 * cp),
                                     root_device=torch.device("cpu"))
    trainer = types.SimpleNamespace(global_rank=0, world_size=2 * cp, node_rank=0, num_nodes=1, log_dir=str(tmp_path),
                                    default_root_dir=str(tmp_path), strategy=strategy, optimizers=[],
                                    accumulate_grad_batches=accumulate, precision="32-true")
    tokens = torch.zeros(batch_shape, dtype=torch.long)
    batch = tokens if batch_shape[-1] % 2 else {"input_ids": tokens}  # (1, 33), (1, 9): T+1 token tensors
    doctor = Doctor()
    doctor.setup(trainer, None, "fit")
    doctor.on_train_batch_end(trainer, None, None, batch, 0)
    found = [f for f in doctor._local if f.id == "dp_overlap"]
    if want_tokens is None:
        assert found == []
        return
    (f,) = found
    assert f.severity == "warning" and f.evidence["needed_tokens"] == 60
    assert (f.evidence["tokens_per_dp_rank"], f.evidence["dp"], f.evidence["link"]) == (want_tokens, 2, "intra-node")


def test_global_batch_changed_against_the_previous_run(tmp_path):
    v0, v1 = tmp_path / "version_0", tmp_path / "version_1"
    write_report(v0, [], {"global_batch": 32, "lr": 0.1, "log_dir": str(v0)})
    assert previous_run(str(v1)) == {"global_batch": 32, "lr": 0.1, "log_dir": str(v0)}
    assert previous_run(str(v0))["global_batch"] == 32  # a reused directory: its own last report
    f = global_batch_changed(previous_run(str(v1)), {"global_batch": 64, "lr": 0.1})
    assert f.id == "global_batch_changed" and f.severity == "warning"
    assert f.evidence["previous_global_batch"] == 32 and f.evidence["global_batch"] == 64
    assert f.evidence["ratio"] == 2 and "0.2" in f.fix
    assert global_batch_changed({"global_batch": 32, "lr": 0.1}, {"global_batch": 64, "lr": 0.2}).severity == "info"
    assert global_batch_changed({"global_batch": 32}, {"global_batch": 32}) is None


def test_mfu_band_seed_004():
    assert mfu_band(0.45, "datasheet").evidence["band"] == "excellent"
    assert mfu_band(0.35, "datasheet").evidence["band"] == "good"
    bad = mfu_band(0.05, "datasheet")
    assert bad.severity == "warning" and bad.evidence["band"] == "badly wrong"
    cpu = mfu_band(0.05, "measured", "measured: cpu fp32")
    assert cpu.severity == "info" and "measured" in cpu.evidence["note"]


def test_unused_and_identical():
    f = unused_parameters(["head.bias"], 10, rank=1)
    assert f.rank == 1 and f.evidence == {"count": 1, "numel": 10, "parameters": ["head.bias"]}
    assert unused_parameters([], 0, 0) is None
    same = {0: ["a", "b"], 1: ["a", "b"], 2: ["c", "d"], 3: ["e", "f"]}
    f = identical_batches(same, [[0, 1, 2, 3]])
    assert f.evidence["ranks_with_same_batches"] == [[0, 1]] and f.evidence["batches_hashed"] == 2
    # tp ranks of one replica legitimately share batches: groups are dp groups only
    assert identical_batches({0: ["a"], 1: ["a"], 2: ["b"], 3: ["b"]}, [[0, 2], [1, 3]]) is None


def test_straggler_from_probe_waits_with_noise_floor():
    # rank 3 arrives 50 ms late each step, so the others wait ~50 ms and it waits ~0
    waits = {r: [50.0 + j for j in (0.1, -0.2, 0.3, 0.0, -0.1)] for r in range(3)}
    waits[3] = [0.01, 0.02, 0.0, 0.01, 0.03]
    f = straggler(waits, step_ms=100.0)
    assert f.id == "straggler" and f.rank == 3 and f.severity == "warning"  # 50 ms of a 100 ms step
    assert f.evidence["late_ms"] == pytest.approx(50.0, abs=0.5) and f.evidence["noise_floor_ms"] == 10.0
    # jitter alone (a few ms, nobody consistently last) is below the floor
    noisy = {r: [5.0 * ((r + k) % 3) for k in range(6)] for r in range(4)}
    assert straggler(noisy, step_ms=100.0) is None
    # above the floor but under 25 % of the step (what CPU contention alone does): information only
    assert straggler(waits, step_ms=400.0).severity == "info"


def _records(stage_ms):
    from meshkit.timeline import TimelineRecord

    out, t = [], 0
    for step in range(4):
        for stage, ms in enumerate(stage_ms):
            for mb, action in ((0, "F"), (0, "B")):
                dur = int(ms * 1e6 / 2 * (1 + 0.01 * step))
                out.append(TimelineRecord(step, stage, stage, mb, action, t, t + dur))
                t += dur
    return out


def test_pp_unbalanced_from_the_timeline():
    f = pp_unbalanced(_records([10.0, 30.0]))
    assert f.id == "pp_unbalanced" and f.evidence["slowest_stage"] == 1
    # stage 1 is 1.5x the mean of (10, 30): imbalance 50 %, the pipeline runs at 20/30 of its rate
    assert f.evidence["imbalance_pct"] == 50.0 and f.evidence["rate_lost_pct"] == pytest.approx(33.3, abs=0.1)
    assert f.evidence["excess_pct"] == 50.0 and f.evidence["noise_floor_pct"] == 10.0  # no jitter: the 10 % share
    assert pp_unbalanced(_records([20.0, 21.0])) is None


def _cuda_trace(path: Path) -> None:
    """One step [100, 900) µs: an AllGather kernel [100, 400) then a GEMM [400, 900): 300 µs exposed."""
    ev = [
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#0", "tid": 1, "ts": 0, "dur": 1000},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "tid": 1, "ts": 10, "dur": 5,
         "args": {"correlation": 1}},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "tid": 1, "ts": 20, "dur": 5,
         "args": {"correlation": 2}},
        {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
         "tid": 7, "ts": 100, "dur": 300, "args": {"correlation": 1}},
        {"ph": "X", "cat": "kernel", "name": "sm90_xmma_gemm_bf16", "tid": 7, "ts": 400, "dur": 500,
         "args": {"correlation": 2}},
    ]
    path.write_text(json.dumps({"distributedInfo": {"rank": 0, "world_size": 1}, "traceEvents": ev}))


def test_zero3_exposed_allgather_on_a_synthetic_cuda_trace(tmp_path):
    from meshkit.doctor.callback import traces_findings
    from meshkit.profiling.trace import load_windows

    _cuda_trace(tmp_path / "rank0.pt.trace.json")
    (window,), _ = load_windows(str(tmp_path))
    (f,) = zero3_exposed_allgather(window.ranks)
    assert traces_findings(str(tmp_path)) == [f]
    assert f.id == "zero3_exposed_allgather" and f.rank == 0
    assert f.evidence["exposed_allgather_ms_per_step"] == 0.3 and f.evidence["step_ms"] == 0.8
    assert f.evidence["fraction"] == 0.375


def _report(regs, smem=0, warps=4, spill=0):
    from meshkit.profiling.occupancy import KernelReport, KernelResources, theoretical_occupancy

    res = KernelResources("k", "sm_90", warps, 3, {}, regs, spill, spill, 0, 0, smem, 0, 0.0)
    return KernelReport(res, theoretical_occupancy("sm_90", registers_per_thread=regs, num_warps=warps,
                                                   shared_bytes=smem))


def test_low_occupancy_on_kernel_reports():
    (f,) = low_occupancy([_report(255, warps=8)])  # 255 regs x 256 threads: one block of 8 warps of 64
    assert f.id == "low_occupancy" and f.evidence["limiter"] == "registers"
    assert f.evidence["occupancy"] == 0.125 and f.evidence["registers_per_thread"] == 255
    assert low_occupancy([_report(32)]) == []
    assert low_occupancy([_report(32, spill=64)])[0].evidence["spill_bytes"] == 64


def test_report_round_trip_and_cli(tmp_path, capsys):
    from meshkit.cli import main

    fs = [Finding("straggler", "warning", 3, {"late_ms": 50.0}, "look at rank 3"),
          Finding("mfu_band", "info", None, {"mfu_pct": 5.0}, "x")]
    write_report(tmp_path / "run", fs, {"global_batch": 8})
    back, run = read_report(tmp_path / "run")
    assert [f.id for f in back] == ["straggler", "mfu_band"] and run == {"global_batch": 8}
    assert main(["doctor", str(tmp_path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["findings"][0] == {"id": "straggler", "severity": "warning", "rank": 3,
                                  "evidence": {"late_ms": 50.0}, "fix": "look at rank 3"}
    assert main(["doctor", str(tmp_path)]) == 0
    assert "WARNING  straggler (rank 3): late_ms=50.0" in capsys.readouterr().out
    assert main(["doctor", str(tmp_path / "missing")]) == 2  # the one catch in meshkit.cli
    assert capsys.readouterr().err == f"meshkit doctor: error: `LOGDIR={str(tmp_path / 'missing')!r}` is not a directory; pass a run's log_dir.\n"
    with pytest.raises(ValueError, match="is not a known finding"):
        Finding("nope", "info", None)


def test_cli_without_a_report_reads_the_run_files(tmp_path):
    _cuda_trace(tmp_path / "rank0.pt.trace.json")
    findings, source = diagnose_logdir(str(tmp_path))
    assert [f.id for f in findings] == ["zero3_exposed_allgather"] and "no doctor.json" in source


def test_every_finding_is_documented():
    doc = (Path(__file__).resolve().parents[2] / "docs" / "doctor.md").read_text()
    for fid, rule in RULES.items():
        assert f"`{fid}`" in doc, fid


def _tiny_module():
    """A one-Linear LightningModule with an unused Linear beside it."""
    import lightning as L
    import torch

    class Tiny(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.lin, self.unused = torch.nn.Linear(4, 1), torch.nn.Linear(2, 2)

        def training_step(self, batch, batch_idx):
            return self.lin(batch).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return Tiny()


def test_one_process_fit_writes_report_tensorboard_and_print(tmp_path, capsys):
    """The callback end to end in one process, switched on the way MFUMonitor would (ensure_doctor)."""
    import lightning as L
    import torch
    from lightning.pytorch.loggers import TensorBoardLogger

    from meshkit.doctor import Doctor, ensure_doctor

    class SwitchOn(L.Callback):
        def setup(self, trainer, pl_module, stage):
            self.doctor = ensure_doctor(trainer, pl_module, stage)

    switch = SwitchOn()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=TensorBoardLogger(tmp_path, name="r"),
                        callbacks=[switch], enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(_tiny_module(), torch.utils.data.DataLoader(torch.randn(8, 4), batch_size=2))
    assert isinstance(switch.doctor, Doctor) and ensure_doctor(trainer, None, "fit") is switch.doctor
    (f,) = switch.doctor.findings
    assert f.id == "unused_parameters" and f.evidence["parameters"] == ["unused.weight", "unused.bias"]
    log_dir = tmp_path / "r" / "version_0"
    back, run = read_report(log_dir)
    assert [b.id for b in back] == ["unused_parameters"] and run["global_batch"] == 2
    events = b"".join(p.read_bytes() for p in log_dir.glob("events.out.tfevents.*"))
    assert b"meshkit/doctor" in events
    assert "WARNING  unused_parameters (rank 0)" in capsys.readouterr().out


def test_mfu_monitor_switches_the_doctor_on(tmp_path):
    import lightning as L
    import torch
    from lightning.pytorch.loggers import TensorBoardLogger

    from meshkit.doctor import Doctor
    from meshkit.profiling.mfu import MFUMonitor

    def fit(monitor):
        trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=TensorBoardLogger(tmp_path, name="m"),
                            callbacks=[monitor], enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False)
        trainer.fit(_tiny_module(), torch.utils.data.DataLoader(torch.randn(8, 4), batch_size=2))
        return [cb for cb in trainer.callbacks if isinstance(cb, Doctor)]

    (doctor,) = fit(MFUMonitor(doctor=True, profile_every=0, measure_flops=False, peak_flops=1e12, flops_per_token=24.0))
    # the Doctor sees the module (an unused parameter) and the monitor's MFU history (its band)
    assert sorted(f.id for f in doctor.findings) == ["mfu_band", "unused_parameters"]
    assert fit(MFUMonitor(profile_every=0, measure_flops=False, peak_flops=1e12, flops_per_token=24.0)) == []


def test_an_unreadable_trace_is_a_finding_not_silence(tmp_path):
    # A trace whose every event is bad used to make the trace checks return nothing ("healthy").
    import json

    from meshkit.doctor.callback import traces_findings

    bad = [{"ph": "X", "name": "aten::mm", "tid": 1, "ts": "x", "dur": 5}]
    (tmp_path / "rank0.pt.trace.json").write_text(json.dumps({"distributedInfo": {"rank": 0}, "traceEvents": bad}))
    (f,) = traces_findings(str(tmp_path))
    assert f.id == "unreadable_trace" and f.severity == "warning"
    assert "no usable events" in f.evidence["error"] and "rank0.pt.trace.json" in f.evidence["error"]
