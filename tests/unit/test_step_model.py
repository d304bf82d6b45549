"""The step-time model, stragglers and profiler windows on synthetic traces with hand-derived answers.

CPU/gloo-shaped (with and without meshkit's phase markers) and CUDA/NCCL-shaped (two ranks, two
profiler windows whose step ids restart, a straggler). Times are µs in the traces, ms in results.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from meshkit.profiling.overlap import analyze, format_analysis
from meshkit.profiling.report import overlap_markdown, straggler_lines
from tests.unit.test_trace import X, write_trace

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def cpu_marked():
    """One 1000 µs step on thread 1 with meshkit's markers (every number below is by hand):

    fb [100,600): mm [100,200); a backward node [300,500) holding mm [300,350) while a gloo
    all-reduce runs [320,480) on thread 2; wait_tensor [550,570).
    optimizer [600,700) (an add_ inside: optimizer, not compute); torch's Optimizer.step span
    [50,700) wraps the closure and is ignored when meshkit's markers are there.
    validation [700,850). The rest of the step, [0,100) and [850,1000), is the loop: data_wait.
    """
    return [
        X("ProfilerStep#1", "user_annotation", 0, 1000, 1),
        X("enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__", "user_annotation", 0, 60, 1),
        X("Optimizer.step#AdamW.step", "user_annotation", 50, 650, 1),
        X("meshkit:forward_backward", "user_annotation", 100, 500, 1),
        X("aten::mm", "cpu_op", 100, 100, 1),
        X("autograd::engine::evaluate_function: MmBackward0", "cpu_op", 300, 200, 1),
        X("MmBackward0", "cpu_op", 300, 200, 1),
        X("aten::mm", "cpu_op", 300, 50, 1),
        X("gloo:all_reduce", "user_annotation", 320, 160, 2),
        X("_c10d_functional::wait_tensor", "cpu_op", 550, 20, 1),
        X("meshkit:optimizer", "user_annotation", 600, 100, 1),
        X("aten::add_", "cpu_op", 610, 40, 1),
        X("meshkit:validation", "user_annotation", 700, 150, 1),
        X("aten::mm", "cpu_op", 720, 50, 1),
    ]


def test_cpu_step_model_by_hand(tmp_path):
    write_trace(tmp_path / "rank0.4.pt.trace.json", 0, 1, cpu_marked())
    r = analyze(str(tmp_path))["ranks"]["0"]
    # exposed: comm [320,480) minus compute [300,350) -> [350,480) = 130, plus the wait 20.
    # compute: [100,200) + [300,350) = 150. other: fb's rest [200,300) + [480,550) + [570,600) = 200.
    assert r["buckets_ms"] == pytest.approx({"compute": 0.150, "exposed_comm": 0.150, "bubble": 0.0,
                                             "data_wait": 0.250, "optimizer": 0.100, "validation": 0.150,
                                             "checkpoint": 0.0, "other": 0.200})
    assert sum(r["buckets_ms"].values()) == pytest.approx(r["wall_ms"])


def test_cpu_without_markers_optimizer_starts_after_the_closure(tmp_path):
    """Lightning's optimizer.step(closure) span [100,900) holds forward+backward: its optimizer part
    starts after the last backward node ends (700)."""
    ev = [X("ProfilerStep#1", "user_annotation", 0, 1000, 1),
          X("enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__", "user_annotation", 0, 100, 1),
          X("Optimizer.step#AdamW.step", "user_annotation", 100, 800, 1),
          X("aten::mm", "cpu_op", 150, 250, 1),
          X("autograd::engine::evaluate_function: MmBackward0", "cpu_op", 400, 300, 1),
          X("aten::mm", "cpu_op", 400, 100, 1),
          X("gloo:all_reduce", "user_annotation", 450, 200, 2),
          X("aten::add_", "cpu_op", 720, 100, 1)]
    write_trace(tmp_path / "rank0.pt.trace.json", 0, 1, ev)
    b = analyze(str(tmp_path))["ranks"]["0"]["buckets_ms"]
    # data [0,100); optimizer [700,900); fb = the rest: [100,700) and [900,1000).
    # exposed: comm [450,650) - compute [400,500) = [500,650) = 150; compute [150,400) + [400,500) = 350;
    # other: [100,150) + [650,700) + [900,1000) = 200.
    assert b == pytest.approx({"compute": 0.35, "exposed_comm": 0.15, "bubble": 0.0, "data_wait": 0.1,
                               "optimizer": 0.2, "validation": 0.0, "checkpoint": 0.0, "other": 0.2})


def cuda_window(rank, base):
    """Two steps of 1000 µs on the host (markers: fb [0,500), optimizer [500,600), the rest the
    loop); on the device a GEMM [10,300) (rank 1: [10,600)), the NCCL all-reduce (rank 0 arrives at
    300, rank 1 at 600: the straggler; both end at 700) and an optimizer kernel [700,750) launched in
    the optimizer phase. Step ids restart at 1 in every window, as torch.profiler writes them."""
    rt = lambda corr, ts: X("cudaLaunchKernel", "cuda_runtime", base + ts, 1, 1, correlation=corr)  # noqa: E731

    def K(name, ts, dur, stream, corr):
        return dict(X(name, "kernel", base + ts, dur, stream, correlation=corr, stream=stream), pid=0)

    ev = []
    for i, off in enumerate((0, 1000)):
        c = 10 * i
        gemm_end = 300 if rank == 0 else 600
        ev += [X(f"ProfilerStep#{i + 1}", "user_annotation", base + off, 1000, 1),
               X("meshkit:forward_backward", "user_annotation", base + off, 500, 1),
               X("meshkit:optimizer", "user_annotation", base + off + 500, 100, 1),
               rt(c + 1, off + 5), rt(c + 2, off + gemm_end - 10), rt(c + 3, off + 550),
               K("sm90_xmma_gemm_bf16", off + 10, gemm_end - 10, 7, c + 1),
               K("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", off + gemm_end, 700 - gemm_end, 20, c + 2),
               K("multi_tensor_apply_kernel", off + 700, 50, 7, c + 3)]
    return ev


def test_cuda_two_windows_and_a_straggler_by_hand(tmp_path):
    for first, base in ((5, 0), (10, 100_000)):
        for r in (0, 1):
            write_trace(tmp_path / f"rank{r}.{first}.pt.trace.json", r, 2, cuda_window(r, base))
    res = analyze(str(tmp_path))
    assert res["windows_used"] == [5, 10] and not res["partial"], res["problems"]
    r0, r1 = res["ranks"]["0"], res["ranks"]["1"]
    assert r0["steps"] == r1["steps"] == 4 and [s["window"] for s in r0["per_step"]] == [5, 5, 10, 10]
    # rank 0, step 1: device window [10, 1010). exposed = NCCL [300,700) = 400; compute [10,300) = 290;
    # optimizer kernel 50 (the host's optimizer phase [500,600) is exposed comm already); device idle
    # while the host is in the loop [600,1000): data_wait [750,1000) = 250; [1000,1010) is the next
    # step's forward+backward on the host: other 10. Step 2 (the window's last) ends with its last
    # kernel: [1010,1750) = exposed 400, compute 290, optimizer 50.
    s1, s2 = r0["per_step"][0]["buckets_ms"], r0["per_step"][1]["buckets_ms"]
    assert s1 == pytest.approx({"compute": 0.29, "exposed_comm": 0.4, "bubble": 0.0, "data_wait": 0.25,
                                "optimizer": 0.05, "validation": 0.0, "checkpoint": 0.0, "other": 0.01})
    assert s2 == pytest.approx(dict(s1, data_wait=0.0, other=0.0))
    # rank 1 computes until 600, then its all-reduce [600,700) is all it waits
    assert r1["per_step"][0]["buckets_ms"]["exposed_comm"] == pytest.approx(0.1)
    assert r1["per_step"][0]["buckets_ms"]["compute"] == pytest.approx(0.59)
    # straggler: rank 1 arrived 300 µs late at every all-reduce; rank 0 waited for it 4 x 0.3 ms
    assert res["straggler"] == {"rank": 1, "caused_ms_per_step": pytest.approx(0.3)}
    assert r0["waiting_for_ms"] == {"1": pytest.approx(1.2)} and "waiting_for_ms" not in r1
    (s,) = [x for x in res["stragglers"] if x["window"] == 5]
    assert (s["collective"], s["group"], s["rank"], s["times_last"]) == ("AllReduce", [0, 1], 1, 2)
    assert s["lateness_ms"] == pytest.approx(0.3)
    # One wording of the straggler facts: `meshkit analyze`'s text and the TensorBoard table print the same
    # lines (TensorBoard's with the collective in a code span, one paragraph each).
    lines = straggler_lines(res)
    assert lines[:2] == ["straggler: rank 1 (made others wait 0.300 ms per step; noise floor 0.000 ms, the run's own "
                         "jitter)", "late arrivals above the noise floor, per process group and collective, the "
                         "largest first:"]
    assert "  late: AllReduce group [0, 1] rank 1 late by 0.300 ms (last 2 of 2 times in window 5)" in lines
    text = format_analysis(res).splitlines()
    assert text[text.index(lines[0]):text.index(lines[0]) + len(lines)] == lines
    board = [line for line in overlap_markdown(res).replace("`AllReduce`", "AllReduce").splitlines() if line]
    assert board[board.index(lines[0]):board.index(lines[0]) + len(lines)] == lines


def test_a_late_arrivals_short_span_matches_the_long_wait_it_caused(tmp_path):
    """Found on a loaded CI host: rank 2 sleeps 300 ms before its part of an all-gather with rank 0;
    rank 2's span is 1.4 ms long and ends 1.6 ms before rank 0's 310 ms wait (its wake-up was late).
    Rank 1 waits for rank 0 in an all-reduce that rank 0 reaches right after. By hand: one all-gather
    instance {0, 2} (ends 1.6 ms apart: within 5 % of the longer span, not within 1 ms), rank 0 waited
    for rank 2 from 10 to 317 ms, rank 1 from 12 to 321 ms for rank 0, who was blocked waiting for
    rank 2 all that time: rank 1 waited for rank 2 (never for rank 0)."""
    spans = {0: [("gloo:all_gather", 10_000, 320_000), ("gloo:all_reduce", 321_000, 322_000)],
             1: [("gloo:all_reduce", 12_000, 322_000)],
             2: [("gloo:all_gather", 317_000, 318_400)]}
    for r, xs in spans.items():
        ev = [X("ProfilerStep#1", "user_annotation", 0, 400_000, 1)]
        ev += [X(name, "user_annotation", s, e - s, 2) for name, s, e in xs]
        write_trace(tmp_path / f"rank{r}.pt.trace.json", r, 3, ev)
    res = analyze(str(tmp_path))
    waits = {r: res["ranks"][str(r)].get("waiting_for_ms") for r in range(3)}
    assert waits == {0: {"2": pytest.approx(307.0)}, 1: {"2": pytest.approx(309.0)}, 2: None}, waits
    assert res["straggler"]["rank"] == 2


def test_healthy_run_names_no_straggler(tmp_path):
    """40 all-reduces, each rank last now and then by 0-40 µs of jitter, one 60 µs outlier: no
    rank is late beyond the noise floor in every step, so nobody is the straggler."""
    import numpy as np

    rng = np.random.default_rng(0)
    jitter = rng.uniform(0, 40, size=(2, 40))
    jitter[1, 7] = 60
    for r in (0, 1):
        ev = [X(f"ProfilerStep#{k + 1}", "user_annotation", 1000 * k, 1000, 1) for k in range(4)]
        for i in range(40):
            t = 100 * i + 20
            ev.append(X("gloo:all_reduce", "user_annotation", t + jitter[r, i], 80 - jitter[r, i], 2))
            ev.append(X("aten::mm", "cpu_op", 100 * i, 20, 1))
        write_trace(tmp_path / f"rank{r}.pt.trace.json", r, 2, ev)
    res = analyze(str(tmp_path))
    assert res["straggler"] is None, res["straggler"]
    assert res["windows"][0]["noise_floor_ms"] > 0.04


def test_analysis_modules_import_neither_torch_nor_lightning(tmp_path):
    """``import meshkit`` and ``meshkit analyze``'s code (trace, overlap, report, the CLI) need numpy and
    msgspec only: neither torch nor Lightning is imported (issue 12: they cost 4.5 CPU-s)."""
    write_trace(tmp_path / "rank0.4.pt.trace.json", 0, 1, cpu_marked())
    code = f"""
import contextlib, io, json, sys
import meshkit, meshkit.timeline
from meshkit.cli import main
from meshkit.profiling.overlap import analyze, format_analysis
from meshkit.profiling.report import overlap_markdown, straggler_lines
from meshkit.profiling.report import overlap_markdown
res = analyze({str(tmp_path)!r})
overlap_markdown(res)
with contextlib.redirect_stdout(io.StringIO()) as text:
    rc = main(["analyze", {str(tmp_path)!r}])
print(json.dumps({{"torch": "torch" in sys.modules, "lightning": "lightning" in sys.modules, "rc": rc,
                  "compute": res["ranks"]["0"]["buckets_ms"]["compute"], "printed": "compute" in text.getvalue()}}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": ROOT})
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"torch": False, "lightning": False, "rc": 0, "compute": pytest.approx(0.15), "printed": True}


def test_stop_signal_wait_is_exposed_comm_waiting_for_the_slow_rank(tmp_path):
    """Two ranks, one 1000 µs step each with meshkit's markers. Rank 1 is slow between batches: its loop
    runs [0,400) before Lightning's stop-signal broadcast; rank 0 enters the broadcast at 50 and waits in it
    until both leave at 420. By hand, rank 0: data_wait [0,50) + [990,1000) = 60 µs, exposed_comm the
    stop-signal span [50,420) = 370 (the broadcast's gloo span [60,420) inside it), waiting for rank 1
    from its span's start (60) to rank 1's (400): 340; forward+backward [420,900): an mm [420,800), the
    rest 100 other; optimizer [900,990) = 90. Rank 1: data_wait [0,400) + [990,1000) = 410, exposed 20
    ([400,420)), compute 380 (the same mm), other 100, optimizer 90. A save inside forward+backward (rank
    0, [800,850)) is checkpoint, once: rank 0's other is 50."""
    for r, (stop0, span0) in {0: (50, 60), 1: (400, 400)}.items():
        ev = [X("ProfilerStep#1", "user_annotation", 0, 1000, 1),
              X("meshkit:stop_signal", "user_annotation", stop0, 420 - stop0, 1),
              X("gloo:broadcast", "user_annotation", span0, 420 - span0, 2),
              X("meshkit:forward_backward", "user_annotation", 420, 480, 1),
              X("aten::mm", "cpu_op", 420, 380, 1),
              X("meshkit:optimizer", "user_annotation", 900, 90, 1)]
        if r == 0:
            ev.append(X("meshkit:checkpoint", "user_annotation", 800, 50, 1))
        write_trace(tmp_path / f"rank{r}.pt.trace.json", r, 2, ev)
    res = analyze(str(tmp_path))
    b0, b1 = res["ranks"]["0"]["buckets_ms"], res["ranks"]["1"]["buckets_ms"]
    assert b0 == pytest.approx({"compute": 0.38, "exposed_comm": 0.37, "bubble": 0.0, "data_wait": 0.06,
                                "optimizer": 0.09, "validation": 0.0, "checkpoint": 0.05, "other": 0.05})
    assert b1 == pytest.approx({"compute": 0.38, "exposed_comm": 0.02, "bubble": 0.0, "data_wait": 0.41,
                                "optimizer": 0.09, "validation": 0.0, "checkpoint": 0.0, "other": 0.1})
    assert res["ranks"]["0"]["waiting_for_ms"] == {"1": pytest.approx(0.34)}
    assert "waiting_for_ms" not in res["ranks"]["1"]


def test_a_collective_call_outlasting_its_gloo_span_is_exposed_comm(tmp_path):
    """The demo's traces (4 ranks on a loaded 2-core host): the main thread sits 3 ms in a
    ``c10d::allreduce_`` whose ``gloo:all_reduce`` took 0.2 ms. One 1000 µs step, forward+backward all of
    it: a functional all_reduce [100,400) holding a clone [110,130) and the c10d call [150,390), its gloo
    span [160,200) on the worker thread, an mm [500,900). By hand: exposed_comm = the call minus the clone
    = 280 µs (not only the 40 µs of the gloo span), compute 20 + 400, other [0,100) + [400,500) + [900,1000)
    = 300; the overlap metrics still see the 40 µs gloo span."""
    ev = [X("ProfilerStep#1", "user_annotation", 0, 1000, 1),
          X("meshkit:forward_backward", "user_annotation", 0, 1000, 1),
          X("_c10d_functional::all_reduce", "cpu_op", 100, 300, 1),
          X("aten::clone", "cpu_op", 110, 20, 1),
          X("c10d::allreduce_", "cpu_op", 150, 240, 1),
          X("gloo:all_reduce", "user_annotation", 160, 40, 2),
          X("aten::mm", "cpu_op", 500, 400, 1)]
    write_trace(tmp_path / "rank0.pt.trace.json", 0, 1, ev)
    r = analyze(str(tmp_path))["ranks"]["0"]
    assert r["buckets_ms"] == pytest.approx({"compute": 0.42, "exposed_comm": 0.28, "bubble": 0.0, "data_wait": 0.0,
                                             "optimizer": 0.0, "validation": 0.0, "checkpoint": 0.0, "other": 0.3})
    assert r["exposed_comm_ms"] == pytest.approx(0.04) and r["comm_ms"] == pytest.approx(0.04)
