"""The MFU waterfall from the peak on synthetic traces: every part derived by hand from the kernels and
operators put in (CUDA/NCCL and CPU shapes), one peak per run, the classification table."""

from __future__ import annotations

import json

import pytest

from meshkit.profiling.overlap import analyze
from meshkit.profiling.report import HOST_OTHER_PARTS, WATERFALL_PARTS, waterfall
from meshkit.profiling.trace import compute_class

BASE = 5_079_082_015_241.0
PEAK = 1e15  # FLOP/s


def X(name, cat, ts, dur, tid, **args):
    return {"ph": "X", "cat": cat, "name": name, "pid": 100, "tid": tid, "ts": BASE + ts, "dur": dur, "args": args}


def K(name, ts, dur, stream, corr):
    return dict(X(name, "kernel", ts, dur, stream, correlation=corr, stream=stream), pid=0)


def write(path, rank, world, events, **meta):
    with open(path, "w") as f:
        json.dump({"distributedInfo": {"rank": rank, "world_size": world}, **meta, "traceEvents": events}, f)


def dp2_tp2_mesh(r):
    """Rank r's ``meshkit_mesh_groups`` at dp_shard=2 x tp=2: tp pairs {0,1} {2,3}, dp_shard pairs {0,2} {1,3}."""
    tp, dp = [r // 2 * 2, r // 2 * 2 + 1], [r % 2, r % 2 + 2]
    return {"dp_replicate": {"group_name": None, "ranks": [r]}, "dp_shard": {"group_name": "5", "ranks": dp},
            "pp": {"group_name": None, "ranks": [r]}, "cp": {"group_name": None, "ranks": [r]},
            "tp": {"group_name": "3", "ranks": tp}}


def cuda_events():
    """One step on the device [10, 105) = 95 µs: GEMMs 30 + 20 µs (matmul 50), a flash-attention kernel
    20 µs, an elementwise and a Triton norm kernel 5 µs each (non_matmul 10), an all-gather hidden under
    compute, a reduce-scatter alone on the device for 10 µs (exposed), and the device idle [80, 85) while
    the host is 3 µs in cudaStreamSynchronize and then 2 µs launching (host_other 5 = sync 3 + launch 2)."""
    rt = lambda corr, ts: X("cudaLaunchKernel", "cuda_runtime", ts, 1, 1, correlation=corr)  # noqa: E731
    return [
        X("ProfilerStep#1", "user_annotation", 0, 100, 1),
        *[rt(c, c) for c in range(1, 9)],
        X("cudaStreamSynchronize", "cuda_runtime", 80, 3, 1),
        K("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", 10, 30, 7, 1),
        K("ncclDevKernel_AllGather_RING_LL", 30, 20, 20, 2),
        K("pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>>", 40, 20, 7, 3),
        K("void at::native::vectorized_elementwise_kernel<4, at::native::AddFunctor<float>>", 60, 5, 7, 4),
        K("_rms_norm_fwd_kernel", 65, 5, 7, 5),
        K("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL", 70, 10, 21, 6),
        K("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTN", 85, 20, 7, 7),
    ]


def test_cuda_waterfall_by_hand(tmp_path):
    # model FLOPs per step: matmul 50 µs at 80 % of peak, attention 20 µs at 50 %
    f_mm, f_att = 0.8 * PEAK * 50e-6, 0.5 * PEAK * 20e-6
    for rank, peak, recompute in ((0, PEAK, 0.0), (1, 2 * PEAK, 0.1)):  # rank 1 recorded another peak
        write(tmp_path / f"rank{rank}.7.pt.trace.json", rank, 2, cuda_events(),
              meshkit_peak={"flops": peak, "source": f"test {rank}"},
              meshkit_flops={"matmul": f_mm, "attention": f_att, "recompute_share": recompute, "source": "test"})
    res = analyze(str(tmp_path))
    assert res["peak_flops"] == PEAK and res["peak_source"] == "as recorded by rank 0: test 0"
    assert any("different peaks" in p and "rank 1: 2e+15" in p for p in res["problems"]), res["problems"]
    r0, r1 = res["ranks"]["0"], res["ranks"]["1"]
    assert r0["peak_flops"] == r1["peak_flops"] == PEAK  # one peak per run
    assert r0["wall_ms"] == pytest.approx(0.095) and r0["buckets_ms"]["other"] == pytest.approx(0.005)
    assert r0["compute_classes_ms"] == {"attention": 0.02, "matmul": 0.05, "non_matmul": 0.01}
    pts = lambda us: 100 * us / 95  # noqa: E731 (µs of the 95 µs step -> MFU points)
    # rank 0: no recompute; delivered: matmul 40 µs-at-peak, attention 10 µs-at-peak
    want0 = {"exposed_comm": pts(10), "host_other": pts(5), "non_matmul": pts(10),
             "attention_efficiency": pts(20 - 10), "matmul_efficiency": pts(50 - 40)}
    # rank 1: 10 % of compute (80 µs) is recompute: 8 µs; the rest splits 20:50:10 as the kernels
    want1 = {"exposed_comm": pts(10), "host_other": pts(5), "recompute": pts(8), "non_matmul": pts(9),
             "attention_efficiency": pts(18 - 10), "matmul_efficiency": pts(45 - 40)}
    for r, want in ((r0, want0), (r1, want1)):
        w = r["waterfall"]
        assert [p["part"] for p in w] == ["peak", *WATERFALL_PARTS, "achieved"]
        assert w[0]["points"] == 100.0 and w[-1]["points"] == pytest.approx(pts(50), abs=1e-6)
        for p in w[1:-1]:
            assert p["points"] == pytest.approx(want.get(p["part"], 0.0), abs=1e-6), p
        assert 100 - sum(p["points"] for p in w[1:-1]) == pytest.approx(w[-1]["points"], abs=1e-5)
        assert r["mfu_pct"] == w[-1]["points"]
        split = r["host_other_split"]
        assert list(split) == list(HOST_OTHER_PARTS)
        assert split == {**dict.fromkeys(HOST_OTHER_PARTS, 0.0), "sync": pytest.approx(pts(3), abs=1e-6),
                         "launch_gaps": pytest.approx(pts(2), abs=1e-6)}


def test_cpu_compute_split_by_hand(tmp_path):
    """CPU operators nest: a linear holds its addmm, SDPA's math form its bmm and softmax; each µs of
    compute is counted once, in the first class of the table that claims it."""
    ev = [
        X("ProfilerStep#1", "user_annotation", 0, 100, 1),
        X("aten::linear", "cpu_op", 0, 30, 1), X("aten::t", "cpu_op", 0, 2, 1), X("aten::addmm", "cpu_op", 2, 28, 1),
        X("aten::scaled_dot_product_attention", "cpu_op", 30, 20, 1), X("aten::bmm", "cpu_op", 31, 5, 1),
        X("aten::_softmax", "cpu_op", 36, 5, 1),
        X("aten::add", "cpu_op", 50, 10, 1),
        X("MmBackward0", "cpu_op", 60, 30, 1), X("aten::mm", "cpu_op", 62, 20, 1),
        X("FSDP::post_backward_reshard (layers.0)", "user_annotation", 92, 4, 1),
    ]
    write(tmp_path / "rank0.1.pt.trace.json", 0, 1, ev, meshkit_peak={"flops": PEAK, "source": "t"},
          meshkit_flops={"matmul": 0.5 * PEAK * 50e-6, "attention": 0.25 * PEAK * 20e-6})
    r = analyze(str(tmp_path))["ranks"]["0"]
    assert r["compute_classes_ms"] == {"attention": 0.02, "matmul": 0.05, "non_matmul": 0.01}
    # other: [60, 62) and [82, 100) = 20 µs: the autograd node outside its mm [60, 62) and [82, 90) 10,
    # the FSDP hook [92, 96) 4, Python between ops [90, 92) and [96, 100) 6
    assert r["host_other_split_ms"] == {**dict.fromkeys(HOST_OTHER_PARTS, 0.0), "op_dispatch": 0.01,
                                        "fsdp_hooks": 0.004, "python_between_ops": 0.006}
    w = {p["part"]: p["points"] for p in r["waterfall"]}
    assert (w["non_matmul"], w["attention_efficiency"], w["matmul_efficiency"], w["host_other"], w["achieved"]) == (
        10.0, 20.0 - 5.0, 50.0 - 25.0, 20.0, 30.0)


def test_no_model_flops_no_waterfall(tmp_path):
    write(tmp_path / "rank0.1.pt.trace.json", 0, 1, cuda_events())
    r = analyze(str(tmp_path))["ranks"]["0"]
    assert r["waterfall"] is None and "meshkit_peak" in r["waterfall_missing"]


@pytest.mark.parametrize("name, kernel, cls", [
    ("aten::mm", False, "matmul"), ("aten::linear", False, "matmul"), ("aten::_scaled_mm", False, "matmul"),
    ("aten::_scaled_dot_product_efficient_attention", False, "attention"),
    ("aten::_flash_attention_backward", False, "attention"), ("aten::native_layer_norm", False, "non_matmul"),
    ("meshkit::rms_norm_fwd", False, "non_matmul"), ("aten::mm_out_weird", False, "non_matmul"),
    ("ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_stages_32x3_nn", True, "matmul"),
    ("cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_nn_align8>", True, "matmul"),
    ("fmha_cutlassF_bf16_aligned_64x128_rf_sm80", True, "attention"),  # attention first: it says cutlass
    ("cudnn_generated_fort_native_sdpa_sm90_knob_7_64x128x128_4x1x1_kernel0_0", True, "attention"),
    ("_attn_fwd", True, "attention"), ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", True, "non_matmul"),
    ("_swiglu_fwd_kernel", True, "non_matmul"),
])
def test_classification_table(name, kernel, cls):
    assert compute_class(name, kernel=kernel) == cls


def test_waterfall_sums_and_refuses_nothing():
    w = waterfall({"compute": 0.4, "recompute": 0.1, "exposed_comm": 0.2, "other": 0.3},
                  {"attention": 0.25, "matmul": 0.5}, {"attention": 0.02, "matmul": 0.1})
    assert 100 - sum(p["points"] for p in w[1:-1]) == pytest.approx(w[-1]["points"]) == pytest.approx(12.0)


def test_docs_explain_every_part_and_show_the_table():
    import os

    from meshkit.profiling.report import WHAT_TO_DO
    from meshkit.profiling.trace import COMPUTE_CLASSES

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(root, "docs", "profiling.md")) as f:
        text = f.read()
    for p in WATERFALL_PARTS:  # a row per part, with its what-to-do line as the code has it
        assert f"| `{p}` | " in text and f"| {WHAT_TO_DO[p]} |" in text, p
    assert all(f"`{p}`" in text for p in HOST_OTHER_PARTS)
    for cls, cpu, kernel in COMPUTE_CLASSES:  # the table as the code has it ('|' escaped in markdown)
        assert f"| `{cls}` | `{cpu.replace('|', chr(92) + '|')}` | `{kernel.replace('|', chr(92) + '|')}` |" in text


MESH = {"dp_replicate": {"group_name": "1", "ranks": [0]}, "dp_shard": {"group_name": "5", "ranks": [0, 2]},
        "pp": {"group_name": "2", "ranks": [0]}, "cp": {"group_name": "4", "ranks": [0]},
        "tp": {"group_name": "3", "ranks": [0, 1]}}
"""Rank 0's mesh groups as MFUMonitor writes them (a 1 x 2 x 1 x 1 x 2 mesh over 4 ranks)."""


def test_cuda_exposed_comm_by_axis_by_hand(tmp_path):
    """NCCL kernels on two process groups: tp (group "3", ranks 0-1) and dp_shard (group "5", ranks 0, 2).
    GEMMs [0, 40) and [55, 80); tp all-reduce [40, 55) (exposed 15, of which [45, 50) also under a dp_shard
    all-gather); dp_shard reduce-scatter [70, 100) (exposed [80, 100): 20); a tp all-reduce [100, 110) whose
    kernel names no group: the record_param_comms before its launch does (exposed 10)."""
    rt = lambda corr, ts: X("cudaLaunchKernel", "cuda_runtime", ts, 1, 1, correlation=corr)  # noqa: E731

    def nccl(name, ts, dur, corr, group=None, ranks=None):
        e = K(name, ts, dur, 20, corr)
        if group is not None:
            e["args"].update({"Process Group Name": group, "Process Group Ranks": ranks})
        return e

    ev = [X("ProfilerStep#1", "user_annotation", 0, 120, 1), *[rt(c, c) for c in range(1, 6)],
          X("record_param_comms", "cpu_op", 5.5, 0.2, 1,
            **{"Process Group Name": "3", "Process Group Ranks": "[0, 1]"}),
          rt(6, 6),
          K("sm90_xmma_gemm_bf16bf16", 0, 40, 7, 1), K("sm90_xmma_gemm_bf16bf16", 55, 25, 7, 2),
          nccl("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", 40, 15, 3, "3", "[0, 1]"),
          nccl("ncclDevKernel_AllGather_RING_LL", 45, 5, 4, "5", "[0, 2]"),
          nccl("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL", 70, 30, 5, "5", "[0, 2]"),
          nccl("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", 100, 10, 6)]
    write(tmp_path / "rank0.1.pt.trace.json", 0, 4, ev, meshkit_mesh_groups=MESH)
    r = analyze(str(tmp_path))["ranks"]["0"]
    assert r["exposed_comm_ms"] == pytest.approx(0.045)  # [40, 55) and [80, 110)
    # the mesh order claims first: dp_shard [45, 50) + [80, 100) = 25, tp [40, 45) + [50, 55) + [100, 110) = 20
    assert r["exposed_comm_by_axis_ms"] == {"dp_replicate": 0.0, "dp_shard": 0.025, "pp": 0.0, "cp": 0.0,
                                            "tp": 0.02}


def test_cpu_exposed_comm_by_axis_by_hand(tmp_path):
    """gloo: each group's collectives run on its own worker thread; the main thread's record_param_comms
    say which group, first in first out (two enqueued back to back), and the group named "7" (not in the
    map by name) is tp by its ranks."""
    pg = lambda ts, g, ranks: X("record_param_comms", "cpu_op", ts, 0.5, 1, **{  # noqa: E731
        "Process Group Name": g, "Process Group Ranks": ranks})
    ev = [X("ProfilerStep#1", "user_annotation", 0, 100, 1), X("ProfilerStep#2", "user_annotation", 100, 100, 1),
          X("aten::mm", "cpu_op", 0, 30, 1), X("aten::mm", "cpu_op", 70, 30, 1),
          pg(30, "7", "[0, 1]"), pg(31, "5", "[0, 2]"),
          X("gloo:all_reduce", "user_annotation", 32, 18, 20),  # tp: exposed [32, 50) 18
          X("gloo:all_gather", "user_annotation", 33, 42, 30),  # dp_shard: exposed [50, 70) 20 (+ under tp)
          X("aten::mm", "cpu_op", 100, 50, 1), pg(150, "5", "[0, 2]"),
          X("gloo:reduce_scatter", "user_annotation", 151, 29, 30)]  # dp_shard: exposed 29
    write(tmp_path / "rank0.1.pt.trace.json", 0, 4, ev, meshkit_mesh_groups=MESH)
    r = analyze(str(tmp_path))["ranks"]["0"]
    assert r["exposed_comm_ms"] == pytest.approx(0.018 + 0.020 + 0.029)
    # mesh order: dp_shard claims [33, 70) ∩ exposed = [33, 70) minus nothing = 37 and 29; tp the rest: [32, 33)
    assert r["exposed_comm_by_axis_ms"] == {"dp_replicate": 0.0, "dp_shard": 0.066, "pp": 0.0, "cp": 0.0,
                                            "tp": 0.001}
    assert [s["exposed_comm_by_axis_ms"]["dp_shard"] for s in r["per_step"]] == [0.037, 0.029]


def test_gloo_groups_from_matched_collectives_by_hand(tmp_path):
    """gloo traces (torch 2.13) record no process group per collective: a worker thread's group is the member
    set its collectives are matched with across ranks. 4 ranks, tp pairs {0,1} {2,3} on thread 20, dp_shard
    pairs {0,2} {1,3} on thread 30 (each pair ends at its own time, ms apart); matmuls [0, 30) and [70, 100) ms."""
    ms = 1000.0
    tp_end = {0: 50, 1: 50, 2: 53, 3: 53}
    dp_end = {0: 65, 2: 65, 1: 69, 3: 69}
    for r in range(4):
        mesh = dp2_tp2_mesh(r)
        ev = [X("ProfilerStep#1", "user_annotation", 0, 100 * ms, 1),
              X("aten::mm", "cpu_op", 0, 30 * ms, 1), X("aten::mm", "cpu_op", 70 * ms, 30 * ms, 1),
              X("gloo:all_reduce", "user_annotation", 30 * ms, (tp_end[r] - 30) * ms, 20),
              X("gloo:all_gather", "user_annotation", 35 * ms, (dp_end[r] - 35) * ms, 30)]
        write(tmp_path / f"rank{r}.1.pt.trace.json", r, 4, ev, meshkit_mesh_groups=mesh)
    res = analyze(str(tmp_path))
    for r, v in res["ranks"].items():
        # exposed [30, max end): dp_shard claims its [35, end) first (mesh order), tp the [30, 35) before it
        dp_ms = dp_end[int(r)] - 35
        assert v["exposed_comm_ms"] == pytest.approx(dp_ms + 5)
        assert v["exposed_comm_by_axis_ms"] == {"dp_replicate": 0.0, "dp_shard": pytest.approx(dp_ms), "pp": 0.0,
                                                "cp": 0.0, "tp": pytest.approx(5.0)}, r


def test_axes_sharing_one_group_map_to_the_largest():
    """meshkit's mesh makes one process group per rank set: at dp_shard=4 the size-1 axes share one
    group and dp_shard may be the world group. A group maps to its largest axis (ties: mesh order)."""
    from meshkit.profiling.overlap import group_axes
    from meshkit.profiling.trace import Intervals, RankTrace

    alone = {"group_name": "1", "ranks": [0]}
    rt = RankTrace(rank=0, paths=[], mesh_groups={"dp_replicate": alone, "dp_shard": {"group_name": "0", "ranks":
                   [0, 1, 2, 3]}, "pp": alone, "cp": alone, "tp": alone},
                   comm_groups={"0": Intervals.union([0], [1]), "1": Intervals.union([2], [3]),
                                "9": Intervals.union([4], [5])},
                   group_ranks={"0": [0, 1, 2, 3], "1": [0], "9": [3, 2, 1, 0]})
    assert group_axes(rt) == {"0": "dp_shard", "1": "dp_replicate", "9": "dp_shard"}  # "9": by its ranks


def test_gloo_groups_when_matching_misses_a_rank(tmp_path):
    """tp=4 (tp spans every rank): rank 3's all-reduce ends 5 ms after the others, outside the matching
    tolerance, so the instance is {0, 1, 2}: their thread's group is the smallest axis holding them (tp);
    rank 3's thread, never matched, is on the one axis of size > 1, which spans every rank."""
    ms = 1000.0
    for r in range(4):
        alone = {"group_name": None, "ranks": [r]}
        mesh = {"dp_replicate": alone, "dp_shard": alone, "pp": alone, "cp": alone,
                "tp": {"group_name": "0", "ranks": [0, 1, 2, 3]}}
        end = 55 if r == 3 else 50
        ev = [X("ProfilerStep#1", "user_annotation", 0, 100 * ms, 1), X("aten::mm", "cpu_op", 0, 30 * ms, 1),
              X("gloo:all_reduce", "user_annotation", 30 * ms, (end - 30) * ms, 20)]
        write(tmp_path / f"rank{r}.1.pt.trace.json", r, 4, ev, meshkit_mesh_groups=mesh)
    res = analyze(str(tmp_path))
    for r, v in res["ranks"].items():
        assert v["exposed_comm_by_axis_ms"] == {"dp_replicate": 0.0, "dp_shard": 0.0, "pp": 0.0, "cp": 0.0,
                                                "tp": pytest.approx(25.0 if r == "3" else 20.0)}, r


def test_world_group_beside_the_axes():
    """dp_shard=2 x tp=2: no axis spans all 4 ranks, so the world group (Lightning's barriers and logged
    reductions) is "world"; a group no axis and not the world is "unmapped"."""
    from meshkit.profiling.overlap import group_axes
    from meshkit.profiling.trace import Intervals, RankTrace

    alone = {"group_name": "9", "ranks": [0]}
    rt = RankTrace(rank=0, paths=[], world_size=4, mesh_groups={
        "dp_replicate": alone, "dp_shard": {"group_name": "2", "ranks": [0, 2]}, "pp": alone, "cp": alone,
        "tp": {"group_name": "1", "ranks": [0, 1]}},
        comm_groups={g: Intervals.union([0], [1]) for g in ("0", "1", "2", "7")},
        group_ranks={"0": [0, 1, 2, 3], "1": [0, 1], "2": [0, 2], "7": [0, 3]})
    assert group_axes(rt) == {"0": "world", "1": "tp", "2": "dp_shard", "7": "unmapped"}


def test_host_other_split_innermost_dtensor_first(tmp_path):
    """DTensor's own containers are tensor parallelism's host cost wherever they run (the demo: 42 ms of
    rank 0's 555 ms, inside FSDP hooks and the autograd engine). One 100 µs backward step: the autograd
    engine [0,100) holding ``MmBackward0`` [5,45) (holding an mm [10,40)) and FSDP's post-backward hook
    [60,90) holding a ``_FromTorchTensor`` [65,80) (holding a view [66,68)). By hand: dtensor 15 − 2 = 13,
    fsdp_hooks 30 − 15 = 15, autograd_engine 100 − 30 (mm) − 2 (view) − 13 − 15 = 40 (the node's own 10
    inside it: an autograd node in the engine is the engine's), op_dispatch 0; host_other 68 points."""
    ev = [X("ProfilerStep#1", "user_annotation", 0, 100, 1),
          X("autograd::engine::evaluate_function: MmBackward0", "cpu_op", 0, 100, 1),
          X("MmBackward0", "cpu_op", 5, 40, 1), X("aten::mm", "cpu_op", 10, 30, 1),
          X("FSDP::post_backward_reduce (layers.0)", "user_annotation", 60, 30, 1),
          X("_FromTorchTensor", "cpu_op", 65, 15, 1), X("aten::view", "cpu_op", 66, 2, 1)]
    write(tmp_path / "rank0.1.pt.trace.json", 0, 1, ev, meshkit_peak={"flops": PEAK, "source": "t"},
          meshkit_flops={"matmul": 0.1 * PEAK * 100e-6, "attention": 0.0})
    r = analyze(str(tmp_path))["ranks"]["0"]
    assert r["host_other_split_ms"] == {**dict.fromkeys(HOST_OTHER_PARTS, 0.0), "dtensor": 0.013,
                                        "fsdp_hooks": 0.015, "autograd_engine": 0.04}
    w = {p["part"]: p["points"] for p in r["waterfall"]}
    assert w["host_other"] == pytest.approx(68.0) and sum(r["host_other_split"].values()) == pytest.approx(68.0)


def test_gloo_stop_signal_broadcast_is_the_world_group(tmp_path):
    """dp_shard=2 x tp=2: Lightning's per-batch stop-signal broadcast runs on the world group, on worker
    threads of its own, and its few instances match by chance with a subset of the ranks (here {1, 2}:
    no axis of rank 1 holds both) or with none: the demo's 'unmapped' 3-5 % of exposed comm. A thread
    that ran a collective started inside ``meshkit:stop_signal`` is the world group's: "world", beside the
    axes. 4 ranks, tp pairs on thread 20 from 30 ms to 50 ({0, 1}) and 53 ms ({2, 3}), the broadcast on
    thread 40 inside the stop signal [0, 10) ms: ranks 1 and 2 end it at 9 ms, ranks 0 and 3 at 6 and 3 ms
    (unmatched); an mm [55, 100)."""
    ms = 1000.0
    bcast_end = {0: 6, 1: 9, 2: 9, 3: 3}
    tp_end = {0: 50, 1: 50, 2: 53, 3: 53}
    for r in range(4):
        mesh = dp2_tp2_mesh(r)
        ev = [X("ProfilerStep#1", "user_annotation", 0, 100 * ms, 1),
              X("meshkit:stop_signal", "user_annotation", 0, 10 * ms, 1),
              X("gloo:broadcast", "user_annotation", 1 * ms, (bcast_end[r] - 1) * ms, 40),
              X("meshkit:forward_backward", "user_annotation", 10 * ms, 90 * ms, 1),
              X("gloo:all_reduce", "user_annotation", 30 * ms, (tp_end[r] - 30) * ms, 20),
              X("aten::mm", "cpu_op", 55 * ms, 45 * ms, 1)]
        write(tmp_path / f"rank{r}.1.pt.trace.json", r, 4, ev, meshkit_mesh_groups=mesh)
    res = analyze(str(tmp_path))
    for r, v in res["ranks"].items():
        # exposed comm (comm not under compute): the broadcast's span and the tp all-reduce's
        b, t = bcast_end[int(r)] - 1, tp_end[int(r)] - 30
        assert v["exposed_comm_ms"] == pytest.approx(b + t)
        assert v["exposed_comm_by_axis_ms"] == {"dp_replicate": 0.0, "dp_shard": 0.0, "pp": 0.0, "cp": 0.0,
                                                "tp": pytest.approx(t), "world": pytest.approx(b)}, r
