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
from meshkit.doctor.checks import FsdpUnit, axis_groups, rank_grid

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


def test_one_fsdp_unit_names_the_unit_and_why():
    # a flat MLP of 161 parameters beside a 20-parameter root: no block stack at all
    f = one_fsdp_unit([FsdpUnit("net", 161), FsdpUnit("unused", 20)], True)
    assert (f.id, f.severity, f.evidence["holds"]) == ("one_fsdp_unit", "warning", "other")
    assert {k: f.evidence[k] for k in ("fsdp_units", "largest_unit", "largest_unit_share", "largest_unit_parameters",
                                       "parameters")} == {"fsdp_units": 2, "largest_unit": "net",
                                                          "largest_unit_share": 0.8895, "largest_unit_parameters": 161,
                                                          "parameters": 181}
    assert "`net` holds no repeated blocks" in f.fix
    # two blocks of a stack left inside the root unit: a wrapping mistake
    f = one_fsdp_unit([FsdpUnit("", 90, embeddings=10, blocks=2, block_parameters=80), FsdpUnit("head", 10)], True)
    assert (f.severity, f.evidence["holds"], f.evidence["blocks"]) == ("warning", "blocks", 2)
    assert "the root module holds 2 blocks of a block stack (90%" in f.fix
    # blocks wrapped, one of them most of the model
    f = one_fsdp_unit([FsdpUnit("layers.0", 80, blocks=1, block_parameters=80),
                       FsdpUnit("layers.1", 10, blocks=1, block_parameters=10), FsdpUnit("", 5, embeddings=5)], True)
    assert (f.severity, f.evidence["holds"], f.evidence["largest_unit"]) == ("warning", "a block", "layers.0")
    # blocks wrapped, the vocabulary outweighs them: the model's shape, "info"
    f = one_fsdp_unit([FsdpUnit("model", 128_064, embeddings=64_000, lm_head=64_000),
                       FsdpUnit("model.layers.0", 37_000, blocks=1, block_parameters=37_000),
                       FsdpUnit("model.layers.1", 37_000, blocks=1, block_parameters=37_000)], True)
    assert (f.severity, f.evidence["holds"], f.evidence["embeddings"], f.evidence["lm_head"], f.evidence["other"]) == (
        "info", "embeddings / lm_head", 64_000, 64_000, 64)
    assert "`model` holds the embeddings and the LM head: 128,000 parameters, 63%" in f.fix
    assert one_fsdp_unit([FsdpUnit("a", 10), FsdpUnit("b", 10), FsdpUnit("c", 10), FsdpUnit("d", 5)], True) is None
    assert one_fsdp_unit([FsdpUnit("a", 100)], False) is None


def _issue_llama(tied: bool):
    """Issue 26's model: a stock transformers Llama, vocabulary 1000 x hidden 64, 2 blocks, inside a module the way
    a LightningModule holds it (``self.model``)."""
    import torch
    import transformers

    config = transformers.LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=tied)
    holder = torch.nn.Module()
    holder.model = transformers.LlamaForCausalLM(config)
    return holder


@pytest.mark.parametrize("tied", [True, False])
def test_one_fsdp_unit_on_a_stock_llama_wrapped_per_block(tied):
    """meshkit's own wrapping (apply_fsdp: per block, then the roots) of a stock Llama, on a 1-rank gloo mesh: the
    tied weight counts once (issue 26 saw 202,048 parameters for a 138,048-parameter model and a warning), and an
    untied vocabulary that outweighs the blocks is "info" naming the root unit, its embeddings and LM head."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from meshkit.doctor.callback import fsdp_units
    from meshkit.plugins.fsdp import apply_fsdp, find_blocks

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = _issue_llama(tied)
        params = sum(p.numel() for p in model.parameters())  # each Parameter once
        apply_fsdp(model, find_blocks(model), init_device_mesh("cpu", (1,), mesh_dim_names=("dp_shard",)))
        units = fsdp_units(model)
    finally:
        dist.destroy_process_group()
    assert params == (138_048 if tied else 202_048)
    assert sum(u.parameters for u in units) == params
    assert sorted(u.name for u in units) == ["model", "model.model.layers.0", "model.model.layers.1"]
    root = next(u for u in units if u.name == "model")
    assert (root.embeddings, root.lm_head, root.tied, root.blocks) == (64_000, 0 if tied else 64_000,
                                                                       64_000 if tied else 0, 0)
    f = one_fsdp_unit(units, True)
    if tied:
        assert f is None  # 64,064 of 138,048: 46 %
    else:
        assert (f.severity, f.evidence["largest_unit"], f.evidence["largest_unit_parameters"]) == ("info", "model",
                                                                                                   128_064)


def test_one_fsdp_unit_blocks_left_in_the_root_unit():
    """A configure_model that shards only the root: the warning names the unit and its 2 unwrapped blocks."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from meshkit.doctor.callback import fsdp_units

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = _issue_llama(tied=True)
        fully_shard(model.model, mesh=init_device_mesh("cpu", (1,)))
        f = one_fsdp_unit(fsdp_units(model), True)
    finally:
        dist.destroy_process_group()
    assert (f.severity, f.evidence["holds"], f.evidence["blocks"], f.evidence["fsdp_units"]) == ("warning", "blocks",
                                                                                                  2, 1)
    assert "`model` holds 2 blocks of a block stack (100%" in f.fix


def test_few_microbatches_m_below_2p():
    # the one micro-batch rule (meshkit.schedules.MICROBATCHES_PER_STAGE): the pipeline's default m is its smallest
    # count >= 2p, and the doctor warns below it
    from meshkit.plugins.pipeline.schedule import resolve_microbatches

    f = few_microbatches("1f1b", pp=4, microbatches=4)
    # 1F1B bubble (p-1)/(m+p-1): 3/7 at m=4, 3/11 at m=8
    assert f.evidence["needed"] == 8 == resolve_microbatches("1f1b", pp=4, batch_size=64)
    assert f.evidence["bubble"] == pytest.approx(3 / 7, abs=1e-4)
    assert f.evidence["bubble_at_2p"] == pytest.approx(3 / 11, abs=1e-4)
    assert few_microbatches("1f1b", pp=4, microbatches=8) is None
    assert few_microbatches("1f1b", pp=1, microbatches=1) is None


def test_dp_overlap_t_below_f_over_w():
    # F = the planner's fitted GEMM efficiency of the GPU x its peak, W = 50 GB/s; a GPU without a fitted figure takes
    # achieved_fraction (0.60: F/W = 0.60 x 989.4e12 / 50e9 = 11873 tokens)
    from meshkit.planner.costs import CALIBRATION

    assert CALIBRATION.achieved_fraction == 0.60
    f = dp_overlap(4096, 989.4e12, 50.0, dp=8, link="inter-node")
    assert f.id == "dp_overlap" and f.severity == "warning"
    assert f.evidence["needed_tokens"] == 11873 and f.evidence["tokens_per_dp_rank"] == 4096
    assert dp_overlap(16384, 989.4e12, 50.0, dp=8, link="inter-node") is None
    assert dp_overlap(1, 989.4e12, 50.0, dp=1, link="intra-node") is None
    assert dp_overlap(1, 1e11, 10.0, dp=2, link="intra-node", measured_peak=True).severity == "info"
    # the per-GPU figure the planner uses: H100's and A100's fitted GEMM efficiencies differ from 0.60 and each other
    for gpu, peak in (("h100-sxm", 989.4e12), ("a100-80gb", 312e12)):
        share = dict(CALIBRATION.gemm_efficiency)[gpu]
        assert share != 0.60
        f = dp_overlap(1, peak, 50.0, dp=8, link="inter-node", gpu=gpu)
        assert f.evidence["needed_tokens"] == round(share * peak / 50e9) and f.evidence["gpu"] == gpu
        assert f.evidence["achieved_tflops"] == round(share * peak / 1e12, 4)


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
    assert f.fix == _report(255, warps=8).hint and f.fix.startswith("cut registers from 255")
    assert low_occupancy([_report(32)]) == []
    spilling = _report(32, spill=64)
    (f,) = low_occupancy([spilling])
    assert f.evidence["spill_bytes"] == 64
    # one wording, the occupancy report's (issue 26: the doctor's fix ignored the spills): spills first
    assert f.fix == spilling.hint and f.fix.startswith("spills 64 B of registers per thread")
    assert f.fix.endswith("then: " + spilling.occupancy.hint)


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


def test_cli_checks_its_path_and_reads_a_report_before_heavy_imports(tmp_path):
    """`meshkit doctor` rejects a missing LOGDIR, and prints a finished run's doctor.json, without importing torch
    or Lightning (issue 26: ~10 s to reject a missing path, torch imported first)."""
    import subprocess
    import sys

    write_report(tmp_path / "run", [Finding("straggler", "warning", 3, {"late_ms": 50.0}, "look at rank 3")], {})
    probe = ("import sys; from meshkit.cli import main; rc = main(['doctor', sys.argv[1]]); "
             "print('heavy:', sorted(m for m in ('torch', 'lightning', 'numpy') if m in sys.modules)); sys.exit(rc)")
    for logdir, rc, says in ((tmp_path / "missing", 2, "is not a directory"), (tmp_path, 0, "straggler (rank 3)")):
        proc = subprocess.run([sys.executable, "-c", probe, str(logdir)], capture_output=True, text=True, timeout=60)
        assert proc.returncode == rc and says in proc.stdout + proc.stderr, proc.stdout + proc.stderr
        assert "heavy: []" in proc.stdout, proc.stdout


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
    """The callback end to end in one process."""
    import lightning as L
    import torch
    from lightning.pytorch.loggers import TensorBoardLogger

    from meshkit.doctor import Doctor

    doctor = Doctor()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=TensorBoardLogger(tmp_path, name="r"),
                        callbacks=[doctor], enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(_tiny_module(), torch.utils.data.DataLoader(torch.randn(8, 4), batch_size=2))
    (f,) = doctor.findings
    assert f.id == "unused_parameters" and f.evidence["parameters"] == ["unused.weight", "unused.bias"]
    log_dir = tmp_path / "r" / "version_0"
    back, run = read_report(log_dir)
    assert [b.id for b in back] == ["unused_parameters"] and run["global_batch"] == 2
    events = b"".join(p.read_bytes() for p in log_dir.glob("events.out.tfevents.*"))
    assert b"meshkit/doctor" in events
    assert "WARNING  unused_parameters (rank 0)" in capsys.readouterr().out


def _fit_callbacks(tmp_path, callbacks):
    import lightning as L
    import torch
    from lightning.pytorch.loggers import TensorBoardLogger

    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=TensorBoardLogger(tmp_path, name="m"),
                        callbacks=callbacks, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(_tiny_module(), torch.utils.data.DataLoader(torch.randn(8, 4), batch_size=2))
    return trainer


def _monitor(**kw):
    from meshkit.profiling.mfu import MFUMonitor

    return MFUMonitor(profile_every=0, measure_flops=False, peak_flops=1e12, flops_per_token=24.0, **kw)


def test_the_doctor_switches_the_mfu_monitor_on(tmp_path):
    from meshkit.doctor import Doctor
    from meshkit.profiling.mfu import MFUMonitor

    setups: list[str] = []

    class Counted(Doctor):  # the hook loop comes back to the Doctor once the monitor is in: no second setup
        def _add_monitor(self, *args):
            setups.append("added")
            super()._add_monitor(*args)

    class CountedMonitor(MFUMonitor):
        def setup(self, *args, **kwargs):
            setups.append("monitor")
            super().setup(*args, **kwargs)

    monitor = CountedMonitor(profile_every=0, measure_flops=False, peak_flops=1e12, flops_per_token=24.0)
    doctor = Counted(mfu=monitor)
    trainer = _fit_callbacks(tmp_path, [doctor])
    mine = [cb for cb in trainer.callbacks if isinstance(cb, (MFUMonitor, Doctor))]
    assert mine == [monitor, doctor]  # the monitor first: it reads its last step before the Doctor reads it
    assert setups == ["added", "monitor"]  # once each, though Lightning's hook loop came back to the Doctor
    # the Doctor sees the module (an unused parameter) and the monitor's MFU history (its band)
    assert sorted(f.id for f in doctor.findings) == ["mfu_band", "unused_parameters"] and len(monitor.history) == 2
    _fit_callbacks(tmp_path, mine)  # a new fit with both in place: found, not added again
    assert setups == ["added", "monitor", "monitor", "added"]
    # mfu=True: the Trainer's own monitor (after or before the Doctor) is used, not a second one
    other = _monitor()
    doctor = Doctor(mfu=True)
    trainer = _fit_callbacks(tmp_path, [doctor, other])
    assert [cb for cb in trainer.callbacks if isinstance(cb, MFUMonitor)] == [other]
    assert sorted(f.id for f in doctor.findings) == ["mfu_band", "unused_parameters"]
    # without mfu= nothing is added
    doctor = Doctor()
    trainer = _fit_callbacks(tmp_path, [doctor])
    assert not [cb for cb in trainer.callbacks if isinstance(cb, MFUMonitor)]
    assert [f.id for f in doctor.findings] == ["unused_parameters"]


def test_the_doctor_refuses_a_second_monitor_and_the_old_switch_says_where_it_went(tmp_path):
    from meshkit.doctor import Doctor
    from meshkit.profiling.mfu import MFUMonitor

    with pytest.raises(ValueError, match=r"Doctor: `mfu=` passes an MFUMonitor but the Trainer's callbacks hold "
                                         r"another one: pass `mfu=True`"):
        _fit_callbacks(tmp_path, [_monitor(), Doctor(mfu=_monitor())])
    with pytest.raises(ValueError, match=r"Doctor: `mfu='yes'` must be True, False or an `MFUMonitor\(...\)`"):
        Doctor(mfu="yes")
    with pytest.raises(ValueError, match=r"MFUMonitor: `doctor=True` moved to the Doctor: use "
                                         r"`callbacks=\[meshkit.Doctor\(mfu=True\)\]`"):
        MFUMonitor(doctor=True)


def test_an_unreadable_trace_is_a_finding_not_silence(tmp_path):
    # A trace whose every event is bad used to make the trace checks return nothing ("healthy").
    import json

    from meshkit.doctor.callback import traces_findings

    bad = [{"ph": "X", "name": "aten::mm", "tid": 1, "ts": "x", "dur": 5}]
    (tmp_path / "rank0.pt.trace.json").write_text(json.dumps({"distributedInfo": {"rank": 0}, "traceEvents": bad}))
    (f,) = traces_findings(str(tmp_path))
    assert f.id == "unreadable_trace" and f.severity == "warning"
    assert "no usable events" in f.evidence["error"] and "rank0.pt.trace.json" in f.evidence["error"]


def test_findings_markdown_is_a_short_table_then_one_section_per_finding():
    """TensorBoard's TEXT tab squeezed a five-column table with the evidence and the fix in cells (issue 26): the
    table now has three short columns and each finding's evidence and fix are lines of their own."""
    from meshkit.doctor.findings import findings_markdown

    fs = [Finding("mfu_band", "info", None, {"mfu_pct": 5.0, "peak": "measured"}, "A sentence long enough to wrap."),
          Finding("straggler", "warning", 3, {"late_ms": 50.0}, "Look at rank 3.")]
    lines = findings_markdown(fs).splitlines()
    table = [line for line in lines if line.startswith("|")]
    assert table == ["| severity | finding | rank |", "|---|---|---|", "| warning | `straggler` | 3 |",
                     "| info | `mfu_band` | all |"]
    assert "#### warning: `straggler` (rank 3)" in lines and "- late_ms: 50.0" in lines
    assert "**Fix**: A sentence long enough to wrap." in lines and "- peak: measured" in lines
    assert lines.index("#### warning: `straggler` (rank 3)") < lines.index("#### info: `mfu_band` (all ranks)")


def _tp_sleeper_trace(rank: int, steps: int = 12, sleeper: int = 1, sleep: int = 600) -> list:
    """A tp pair: ``sleeper`` sleeps ``sleep`` µs in its forward before the first of 4 collectives per step; its peer
    waits in that collective, and from then on both arrive together (0-2 µs of jitter)."""
    from tests.unit.test_trace import X

    events = []
    for k in range(steps):
        t0 = k * 2000
        events.append(X(f"ProfilerStep#{k + 1}", "user_annotation", t0, 2000, 1))
        shift, prev_end = 0, t0
        for c in range(4):
            nominal = t0 + 100 + c * 200 + shift
            late = [(k + c + r) % 3 + (sleep if r == sleeper and c == 0 else 0) for r in (0, 1)]
            arrive, last = nominal + late[rank], nominal + max(late)
            events.append(X("aten::mm", "cpu_op", prev_end, arrive - prev_end, 1))
            events.append(X("gloo:all_reduce", "user_annotation", arrive, last + 20 - arrive, 2))
            prev_end, shift = last + 20, sleep
    return events


def test_doctor_straggler_is_the_rank_meshkit_analyze_names(tmp_path):
    # Issue 27 item 8: with one tp rank sleeping in its forward the doctor named its tp peer ("replace it"): at the
    # step-boundary probe the peer, which had waited for it inside the step, looked late.
    from meshkit.doctor.callback import traces_findings, with_traces
    from meshkit.profiling.overlap import analyze
    from tests.unit.test_trace import write_trace

    for r in (0, 1):
        write_trace(tmp_path / f"rank{r}.pt.trace.json", r, 2, _tp_sleeper_trace(r))
    named = analyze(str(tmp_path))["straggler"]
    assert named == {"rank": 1, "caused_ms_per_step": 0.6}
    (f,) = [f for f in traces_findings(str(tmp_path)) if f.id == "straggler"]
    assert f.rank == named["rank"] == 1 and f.evidence["caused_ms_per_step"] == 0.6
    assert f.evidence["source"] == "profiler traces" and "replace it" in f.fix
    probe = straggler({0: [1.0] * 10, 1: [60.0] * 10}, step_ms=100.0)  # the victim, rank 0, arrives last
    assert probe.rank == 0 and "may be the victim" in probe.fix and "replace it" not in probe.fix
    assert [(g.id, g.rank) for g in with_traces([probe], [f], traced=True)] == [("straggler", 1)]
    assert with_traces([probe], [], traced=True) == []  # traces without a straggler overrule the probe's guess
    assert with_traces([probe], [], traced=False) == [probe]
