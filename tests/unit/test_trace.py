"""Trace analysis on synthetic Kineto traces (CPU/gloo and CUDA/NCCL shapes), expected values by hand."""

from __future__ import annotations

import gzip
import json
import os

import numpy as np
import pytest

from meshkit.profiling import trace as T
from meshkit.profiling.overlap import analyze, configure_parser, run_cli
from meshkit.profiling.trace import Intervals

BASE = 5_079_082_015_241.0  # a realistic absolute µs timestamp: precision must survive it


def write_trace(path, rank, world, events, kineto_style=True, gz=False):
    """Write events the way torch's tensorboard_trace_handler does (Kineto layout) or compactly."""
    if kineto_style:
        body = ",\n".join("  " + json.dumps(e, indent=2).replace("\n", "\n  ") for e in events)
        text = ('{\n  "schemaVersion": 1,\n  "distributedInfo": ' + json.dumps({"backend": "gloo", "rank": rank,
                "world_size": world}) + ',\n  "traceEvents": [\n' + body + '\n  ],\n  "traceName": "x"\n}')
    else:
        text = json.dumps({"distributedInfo": {"rank": rank, "world_size": world}, "traceEvents": events})
    if gz:
        with gzip.open(path, "wt") as f:
            f.write(text)
    else:
        with open(path, "w") as f:
            f.write(text)


def X(name, cat, ts, dur, tid, **args):
    return {"ph": "X", "cat": cat, "name": name, "pid": 100, "tid": tid, "ts": BASE + ts, "dur": dur, "args": args}


def cpu_rank(rank):
    """Two steps. Rank 0 / rank 1 (rank 1's all_reduce starts 5 and 20 µs later)."""
    late1, late2 = (0, 0) if rank == 0 else (5, 20)
    mm1 = 40 if rank == 0 else 35
    mm3 = 50 if rank == 0 else 70
    return [
        X("ProfilerStep#1", "user_annotation", 0, 100, 1),
        X("aten::mm", "cpu_op", 0, mm1, 1),
        X("aten::add", "cpu_op", 10, 10, 1),  # nested: must not count twice
        X("c10d::allreduce_", "cpu_op", 40, 2, 1),  # enqueue only: not compute
        X("aten::mm", "cpu_op", 50, 20, 1),
        X("gloo:all_reduce", "user_annotation", 30 + late1, 30 - late1, 2),
        X("ProfilerStep#2", "user_annotation", 100, 100, 1),
        X("aten::mm", "cpu_op", 100, mm3, 1),
        X("gloo:all_reduce", "user_annotation", 150 + late2, 40 - late2, 2),
        {"ph": "i", "name": "instant", "ts": BASE, "pid": 100, "tid": 1},
        {"ph": "M", "name": "thread_name", "pid": 100, "tid": 2, "args": {"name": "gloo"}},
    ]


@pytest.fixture
def cpu_dir(tmp_path):
    write_trace(tmp_path / "rank0.111.pt.trace.json", 0, 2, cpu_rank(0), kineto_style=True)
    write_trace(tmp_path / "rank1.222.pt.trace.json.gz", 1, 2, cpu_rank(1), kineto_style=False, gz=True)
    return tmp_path


def test_cpu_gloo_shape_by_hand(cpu_dir):
    res = analyze(str(cpu_dir))
    assert not res["partial"], res["problems"]
    r0, r1 = res["ranks"]["0"], res["ranks"]["1"]
    assert r0["shape"] == r1["shape"] == "cpu"
    # rank 0, step 1: compute [0,40)∪[50,70)=60, comm [30,60)=30, overlap [30,40)+[50,60)=20,
    # busy [0,70)=70 -> idle 30. Step 2: compute [100,150)=50, comm [150,190)=40, overlap 0, idle 10.
    assert r0["steps"] == 2
    assert r0["compute_ms"] == pytest.approx(0.110)
    assert r0["comm_ms"] == pytest.approx(0.070)
    assert r0["overlapped_comm_ms"] == pytest.approx(0.020)
    assert r0["exposed_comm_ms"] == pytest.approx(0.050)
    assert r0["idle_ms"] == pytest.approx(0.040)
    assert r0["overlap_pct"] == pytest.approx(100 * 20 / 70, abs=1e-3)
    s1 = r0["per_step"][0]
    assert (s1["step"], s1["compute_ms"], s1["idle_ms"]) == (1, pytest.approx(0.06), pytest.approx(0.03))
    # rank 1: step 1 compute [0,35)∪[50,70)=55, comm [35,60)=25, overlap [50,60)=10, idle 30;
    # step 2 compute [100,170)=70, comm [170,190)=20, overlap 0, idle 10.
    assert r1["compute_ms"] == pytest.approx(0.125)
    assert r1["comm_ms"] == pytest.approx(0.045)
    assert r1["overlapped_comm_ms"] == pytest.approx(0.010)
    assert r1["exposed_comm_ms"] == pytest.approx(0.035)
    assert r1["idle_ms"] == pytest.approx(0.040)
    # both all_reduces: rank 1 started last, by 5 µs and 20 µs -> mean 12.5 µs
    (s,) = res["stragglers"]
    assert (s["collective"], s["rank"], s["times_last"], s["instances"]) == ("gloo:all_reduce", 1, 2, 2)
    assert s["lateness_ms"] == pytest.approx(0.0125)
    assert s["max_lateness_ms"] == pytest.approx(0.020)


def cuda_rank(rank):
    d = 3 if rank == 1 else 0  # rank 1's NCCL kernel starts 3 µs later
    rt = lambda corr, ts: X("cudaLaunchKernel", "cuda_runtime", ts, 1, 1, correlation=corr)  # noqa: E731

    def K(name, cat, ts, dur, stream, corr):
        e = X(name, cat, ts, dur, stream, correlation=corr, stream=stream)
        e["pid"] = 0
        return e

    return [
        X("ProfilerStep#5", "user_annotation", 0, 50, 1),
        rt(1, 1), rt(2, 2), rt(3, 3), rt(4, 4), rt(9, 70),  # 9 is launched after the step
        K("sm80_xmma_gemm_bf16", "kernel", 10, 30, 7, 1),
        K("elementwise_kernel", "kernel", 47, 13, 7, 2),
        K("ncclDevKernel_AllReduce_Sum_f32_RING_LL", "kernel", 30 + d, 11 - d, 20, 3),
        K("Memcpy DtoD (Device -> Device)", "gpu_memcpy", 42, 2, 21, 4),
        K("sm80_xmma_gemm_bf16", "kernel", 100, 10, 7, 9),
    ]


def test_cuda_nccl_shape_by_hand(tmp_path):
    for r in (0, 1):
        write_trace(tmp_path / f"host_rank{r}.pt.trace.json", r, 2, cuda_rank(r))
    res = analyze(str(tmp_path))
    r0 = res["ranks"]["0"]
    assert r0["shape"] == "cuda" and r0["steps"] == 1
    # device window [10, 60) (kernel 9 was launched outside the step): 50 µs.
    # compute [10,40)∪[47,60)=43; comm [30,41)=11; overlap [30,40)=10 -> 90.909 %; exposed 1;
    # busy [10,41)∪[42,44)∪[47,60)=46 -> idle 4.
    assert r0["wall_ms"] == pytest.approx(0.050)
    assert r0["compute_ms"] == pytest.approx(0.043)
    assert r0["comm_ms"] == pytest.approx(0.011)
    assert r0["overlapped_comm_ms"] == pytest.approx(0.010)
    assert r0["exposed_comm_ms"] == pytest.approx(0.001)
    assert r0["idle_ms"] == pytest.approx(0.004)
    assert r0["memory_ms"] == pytest.approx(0.002)
    assert r0["overlap_pct"] == pytest.approx(100 * 10 / 11, abs=1e-3)
    # rank 1: comm [33,41)=8, overlap [33,40)=7
    assert res["ranks"]["1"]["overlapped_comm_ms"] == pytest.approx(0.007)
    (s,) = res["stragglers"]
    assert (s["collective"], s["rank"], s["lateness_ms"]) == ("AllReduce", 1, pytest.approx(0.003))


def test_cuda_steps_that_overlap_on_the_device_are_not_counted_twice(tmp_path):
    """Step 1's last (NCCL) kernel is still running when step 2's first kernel starts."""
    rt = lambda corr, ts: X("cudaLaunchKernel", "cuda_runtime", ts, 1, 1, correlation=corr)  # noqa: E731

    def K(name, ts, dur, stream, corr):
        return dict(X(name, "kernel", ts, dur, stream, correlation=corr, stream=stream), pid=0)

    ev = [X("ProfilerStep#1", "user_annotation", 0, 50, 1), X("ProfilerStep#2", "user_annotation", 50, 50, 1),
          rt(1, 1), rt(2, 2), rt(3, 51),
          K("gemm", 10, 30, 7, 1), K("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 40, 40, 20, 2),
          K("gemm", 60, 30, 7, 3)]
    write_trace(tmp_path / "rank0.pt.trace.json", 0, 1, ev)
    r = analyze(str(tmp_path))["ranks"]["0"]
    # device windows [10, 60) and [60, 90) (the first ends where the second begins, not at 80):
    # comm [40,80) = 40 counted once: 20 + 20; overlapped with [60,90) compute: 20 (in step 2).
    assert [s["wall_ms"] for s in r["per_step"]] == [pytest.approx(0.050), pytest.approx(0.030)]
    assert [s["comm_ms"] for s in r["per_step"]] == [pytest.approx(0.020), pytest.approx(0.020)]
    assert r["comm_ms"] == pytest.approx(0.040) and r["overlapped_comm_ms"] == pytest.approx(0.020)
    assert r["overlap_pct"] == pytest.approx(50.0)


def test_pipeline_spans_give_bubble(tmp_path):
    ev = [X("ProfilerStep#0", "user_annotation", 0, 100, 1),
          X("PP:forward", "user_annotation", 10, 30, 1), X("PP:backward", "user_annotation", 60, 30, 1),
          X("aten::mm", "cpu_op", 10, 30, 1)]
    write_trace(tmp_path / "rank0.pt.trace.json", 0, 1, ev)
    assert analyze(str(tmp_path))["ranks"]["0"]["bubble_ms"] == pytest.approx(0.040)  # 100 − 60


def _fields(ev):
    """What the typed reader keeps of a JSON event: a complete ("X") event's fields, another's phase."""
    if ev.get("ph") != "X":
        return (ev.get("ph"),)
    corr = (ev.get("args") or {}).get("correlation")
    return ("X", ev.get("cat", ""), ev.get("name", ""), ev.get("ts"), ev.get("dur"), ev.get("tid"), corr)


def _kept(e):
    if e.ph != "X":
        return (e.ph,)
    return (e.ph, e.cat, e.name, e.ts, e.dur, e.tid, e.args.correlation if e.args else None)


def test_streaming_parser_equals_json_load(tmp_path, monkeypatch):
    events = cpu_rank(0) * 50 + [X("k", "kernel", 5, 1, 7, correlation=42)]
    for style in (True, False):
        path = tmp_path / f"s{style}.trace.json"
        write_trace(path, 0, 1, events, kineto_style=style)
        monkeypatch.setattr(T, "CHUNK_BYTES", 97)  # force many refills, mid-event cuts
        meta = {}
        with T._open_binary(str(path)) as f:
            got = [e for batch in T._stream_events(f, meta) for e in batch]
        want = json.load(open(path))["traceEvents"]
        assert [_kept(e) for e in got] == [_fields(e) for e in want]
        assert {e["ph"] for e in want} > {"X"}  # other phases are in the file, read as their phase only
        assert (meta.get("_batches", 0) > 0) == style  # Kineto's layout takes the batched fast path
        assert meta["distributedInfo"]["rank"] == 0
        assert style is False or meta["traceName"] == "x"


def test_other_phases_and_unread_categories_change_nothing(tmp_path):
    """Flow ("s"/"f"), counter and metadata events, an unknown or missing phase (which send a batch down
    the plain-JSON path) and complete events of a category the analysis does not read leave every figure
    as it is; the unread complete events still count as complete, a bad one among them as bad."""
    base = cuda_rank(0)
    extra = [{"ph": "s", "id": 1, "pid": 100, "tid": 1, "ts": BASE + 1, "cat": "ac2g", "name": "ac2g"},
             {"ph": "f", "id": 1, "pid": 0, "tid": 7, "ts": BASE + 10, "cat": "ac2g", "name": "ac2g", "bp": "e"},
             {"ph": "C", "name": "mem", "pid": 0, "tid": 0, "ts": BASE + 5, "cat": "kernel", "args": {"v": 1}},
             X("gpu_user_annotation", "gpu_user_annotation", 0, 60, 7),
             X("Trace", "Trace", 0, 100, 1)]
    odd = [{"ph": "Z", "name": "?", "ts": BASE, "cat": "kernel"}, {"name": "no phase", "cat": "cpu_op", "ts": BASE}]
    want = None
    for i, (events, style) in enumerate([(base, True), (base + extra, True), (base + extra, False),
                                         (odd + base + extra, True)]):
        d = tmp_path / str(i)
        d.mkdir()
        write_trace(d / "rank0.pt.trace.json", 0, 1, events, kineto_style=style)
        r = analyze(str(d))["ranks"]["0"]
        sink, _, _ = T.load_trace(str(d / "rank0.pt.trace.json"))
        assert sink.complete == len([e for e in events if e.get("ph") == "X"])
        want = want or r
        assert r == want, i
    bad = base + [dict(X("Trace", "Trace", 0, 100, 1), dur=-5.0)]
    write_trace(tmp_path / "rank0.pt.trace.json", 0, 1, bad)
    sink, _, _ = T.load_trace(str(tmp_path / "rank0.pt.trace.json"))
    assert (sink.complete, sink.bad) == (len(base), {"dur negative": 1})


def test_values_off_the_schema_are_read_loosely(tmp_path):
    """A batch whose values do not fit the typed schema (a float tid) is still read; a string ts is
    not a number: tests/unit/test_trace_bad_events.py."""
    ev = [X("ProfilerStep#0", "user_annotation", 0, 100, 1), X("aten::mm", "cpu_op", 0, 60, 1),
          X("gloo:all_reduce", "user_annotation", 40, 40, 2.0)]
    write_trace(tmp_path / "rank0.pt.trace.json", 0, 1, ev)
    r = analyze(str(tmp_path))["ranks"]["0"]
    assert (r["overlap_pct"], r["exposed_comm_ms"], r["idle_ms"]) == (50.0, 0.02, 0.02)


def test_interval_algebra_matches_brute_force():
    rng = np.random.default_rng(0)
    s = rng.uniform(0, 100, 200)
    e = s + rng.uniform(0, 5, 200)
    u = Intervals.union(s, e)
    grid = np.arange(0, 110, 0.01) + 0.005  # 1e-2 resolution indicator integral
    covered = ((grid[:, None] >= s) & (grid[:, None] < e)).any(axis=1)
    for lo, hi in [(0, 110), (20.5, 30.25), (50, 50)]:
        brute = covered[(grid >= lo) & (grid < hi)].sum() * 0.01
        assert u.measure([lo], [hi])[0] == pytest.approx(brute, abs=0.05)
    assert np.all(u.starts[1:] > u.ends[:-1])


# --------------------------------------------------------------------------------- bad input


def test_missing_logdir_and_no_traces(tmp_path):
    with pytest.raises(ValueError, match=r"logdir='.*nope'.*does not exist"):
        analyze(str(tmp_path / "nope"))
    with pytest.raises(ValueError, match=r"no trace files"):
        analyze(str(tmp_path))


def test_empty_file_only_is_a_clear_error(tmp_path):
    (tmp_path / "rank0.pt.trace.json").write_text("")
    with pytest.raises(ValueError, match=r"no usable trace.*the file is empty"):
        analyze(str(tmp_path))


def test_truncated_rank_is_flagged_partial(cpu_dir):
    path = cpu_dir / "rank0.111.pt.trace.json"
    text = path.read_text()
    path.write_text(text[: int(len(text) * 0.6)])  # a crash mid-write
    res = analyze(str(cpu_dir))
    assert res["partial"]
    assert any("rank 0" in p and "truncated" in p for p in res["problems"])
    assert res["ranks"]["0"]["partial"] and not res["ranks"]["1"]["partial"]
    assert res["ranks"]["0"]["steps"] >= 1  # what was read before the cut is kept


@pytest.mark.parametrize("damage", ["cut", "flip"])
def test_corrupt_gzip_is_flagged_partial(cpu_dir, damage):
    path = cpu_dir / "rank1.222.pt.trace.json.gz"
    data = bytearray(path.read_bytes())
    if damage == "cut":
        data = data[: len(data) // 2]
    else:
        for i in range(len(data) // 2, len(data) // 2 + 20):
            data[i] ^= 0xFF
    path.write_bytes(bytes(data))
    res = analyze(str(cpu_dir))
    assert res["partial"]
    assert any("rank 1" in p and ("gzip" in p or "truncated" in p) for p in res["problems"]), res["problems"]
    assert res["ranks"]["0"]["compute_ms"] == pytest.approx(0.110)  # the healthy rank is unaffected


def test_missing_rank_is_flagged(tmp_path):
    write_trace(tmp_path / "rank0.pt.trace.json", 0, 4, cpu_rank(0))
    write_trace(tmp_path / "rank2.pt.trace.json", 2, 4, cpu_rank(1))
    res = analyze(str(tmp_path))
    assert res["partial"] and res["missing_ranks"] == [1, 3]
    assert any("missing ranks [1, 3] of world size 4" in p for p in res["problems"])


def test_cli_json_shape_and_errors(cpu_dir, capsys):
    import argparse

    p = argparse.ArgumentParser()
    configure_parser(p)
    assert run_cli(p.parse_args([str(cpu_dir), "--json"])) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("steps", "compute_ms", "comm_ms", "overlapped_comm_ms", "exposed_comm_ms", "idle_ms", "overlap_pct"):
        assert key in out["ranks"]["0"]
    assert set(out["stragglers"][0]) >= {"collective", "rank", "lateness_ms"}
    assert run_cli(p.parse_args([str(cpu_dir)])) == 0
    text = capsys.readouterr().out
    assert "late arrivals above the noise floor" in text and "totals over each rank's profiled steps, profiler windows [" in text
    assert "step model, ms summed over the same steps" in text
    from meshkit.cli import main  # user errors: the one catch in meshkit.cli

    assert main(["analyze", str(cpu_dir / "missing")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("meshkit analyze: error: ") and "does not exist" in err
