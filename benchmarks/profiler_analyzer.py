"""Analyzer throughput: `meshkit analyze` vs torch-tb-profiler's loader (and HTA where installed)
on one synthetic multi-rank trace directory of >= 100 MB (Kineto layout, CPU/gloo or CUDA/NCCL shape).

Each provider runs in a fresh subprocess: wall time, CPU time (MB per CPU-second is the
per-core throughput, robust to a loaded machine) and peak RSS:

    python benchmarks/profiler_analyzer.py --mb 100 --ranks 4 [--shape cuda]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cpu_step(rank: int, step: int, ts: float, n: int) -> list[dict]:
    """200 aten ops on the main thread and 4 gloo collectives on a worker thread."""
    events = [{"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{step}", "pid": 1, "tid": 1,
               "ts": ts, "dur": 2000.0, "args": {"External id": n}}]
    for i in range(200):
        events.append({"ph": "X", "cat": "cpu_op", "name": "aten::mm" if i % 3 else "aten::add", "pid": 1,
                       "tid": 1, "ts": ts + 8 * i, "dur": 6.5, "args": {"External id": n + i,
                       "Record function id": 0, "Sequence number": n + i, "Fwd thread id": 0}})
    for c in range(4):
        events.append({"ph": "X", "cat": "user_annotation", "name": "gloo:all_reduce", "pid": 1, "tid": 2,
                       "ts": ts + 400 * c + 13 * rank, "dur": 300.0, "args": {"External id": n + 300 + c}})
    return events


def _cuda_step(rank: int, step: int, ts: float, n: int) -> list[dict]:
    """60 aten ops each launching one kernel on stream 7, and 4 NCCL all-reduce kernels on stream 20."""
    events = [{"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{step}", "pid": 1, "tid": 1,
               "ts": ts, "dur": 2000.0, "args": {"External id": n}}]
    for i in range(64):
        corr, t = n + i, ts + 30 * i
        nccl = i % 16 == 15
        name = "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevComm*, unsigned long, ncclWork*)" if nccl else \
            "void cutlass::Kernel<cutlass_80_tensorop_s1688gemm_128x128_32x3_nn_align4>(Params)"
        events += [
            {"ph": "X", "cat": "cpu_op", "name": "c10d::allreduce_" if nccl else "aten::mm", "pid": 1, "tid": 1,
             "ts": t, "dur": 8.0, "args": {"External id": corr, "Record function id": 0, "Sequence number": corr}},
            {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1, "ts": t + 2,
             "dur": 4.0, "args": {"External id": corr, "cbid": 211, "correlation": corr}},
            {"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": 20 if nccl else 7, "ts": t + 10 + 3 * rank,
             "dur": 120.0 if nccl else 25.0, "args": {"External id": corr, "queued": 0, "device": 0, "context": 1,
             "stream": 20 if nccl else 7, "correlation": corr, "registers per thread": 128, "shared memory": 0,
             "blocks per SM": 1.2, "warps per SM": 4.8, "grid": [132, 1, 1], "block": [128, 1, 1],
             "est. achieved occupancy %": 6}},
            {"ph": "f", "id": corr, "pid": 0, "tid": 20 if nccl else 7, "ts": t + 10, "cat": "ac2g", "name": "ac2g",
             "bp": "e"},
        ]
    return events


def write_rank(path: str, rank: int, world: int, target_bytes: int, shape: str = "cpu") -> int:
    """One rank's trace in Kineto's layout, steps appended until the file reaches ``target_bytes``."""
    backend, step_events = ("gloo", _cpu_step) if shape == "cpu" else ("nccl", _cuda_step)
    with open(path, "w") as f:
        f.write('{\n  "schemaVersion": 1,\n  "deviceProperties": [],\n  "distributedInfo": '
                + json.dumps({"backend": backend, "rank": rank, "world_size": world}) + ',\n  "traceEvents": [\n')
        first, ts, step, n = True, 1_000_000.0, 0, 0
        while f.tell() < target_bytes:
            for e in step_events(rank, step, ts, n):
                f.write(("" if first else ",\n") + "  " + json.dumps(e, indent=2).replace("\n", "\n  "))
                first = False
            ts += 2000.0
            step += 1
            n += 1000
        f.write('\n  ],\n  "traceName": "synthetic"\n}')
        return f.tell()


def run_provider(provider: str, trace_dir: str) -> dict:
    files = sorted(os.path.join(trace_dir, f) for f in os.listdir(trace_dir))
    # imports first: the clocks measure the analysis, not importing torch (which `import meshkit` does)
    if provider == "meshkit":
        sys.path.insert(0, ROOT)
        from meshkit.profiling.overlap import analyze
    elif provider == "torch_tb_profiler":
        from torch_tb_profiler.profiler.data import RunProfileData
    elif provider == "hta":
        from hta.trace_analysis import TraceAnalysis  # type: ignore[import-not-found]
    else:
        raise ValueError(f"unknown provider {provider!r}")
    use = resource.getrusage(resource.RUSAGE_SELF)
    rss0 = use.ru_maxrss / 1024
    cpu0 = use.ru_utime + use.ru_stime
    t0 = time.perf_counter()
    if provider == "meshkit":
        result = analyze(trace_dir)
        detail = {"ranks": len(result["ranks"]), "partial": result["partial"],
                  "overlap_pct": [v["overlap_pct"] for _, v in sorted(result["ranks"].items())]}
    elif provider == "torch_tb_profiler":
        cache = tempfile.mkdtemp()
        for path in files:
            worker = os.path.basename(path).split(".")[0]
            RunProfileData.parse(worker, None, path, cache)
        detail = {"files": len(files)}
    else:
        df = TraceAnalysis(trace_dir=trace_dir).get_comm_comp_overlap()
        detail = {"overlap_pct": [float(x) for x in df.sort_values("rank")["comp_comm_overlap_pctg"]]}
    seconds = time.perf_counter() - t0
    use = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)  # torch-tb-profiler may fork workers
    cpu = use.ru_utime + use.ru_stime + children.ru_utime + children.ru_stime - cpu0
    return {"seconds": seconds, "cpu_seconds": cpu, "maxrss_mb": use.ru_maxrss / 1024,
            "rss_before_mb": rss0, **detail}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=100.0, help="total trace size in MB")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--shape", choices=("cpu", "cuda"), default="cpu",
                    help="cpu: aten ops and gloo spans; cuda: kernels, launches and NCCL kernels")
    ap.add_argument("--dir", default=None, help="reuse / write the synthetic traces here")
    ap.add_argument("--provider", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.provider:
        print(json.dumps(run_provider(args.provider, args.dir)))
        return
    trace_dir = args.dir or tempfile.mkdtemp(prefix="meshkit_traces_")
    os.makedirs(trace_dir, exist_ok=True)
    total = 0
    for r in range(args.ranks):
        path = os.path.join(trace_dir, f"rank{r}.1.pt.trace.json")
        if os.path.exists(path) and os.path.getsize(path) >= args.mb * 1e6 / args.ranks:
            total += os.path.getsize(path)
        else:
            total += write_rank(path, r, args.ranks, int(args.mb * 1e6 / args.ranks), args.shape)
    print(f"trace directory {trace_dir}: {args.ranks} ranks, {args.shape} shape, {total / 1e6:.1f} MB")
    rows = {}
    for provider in ("meshkit", "torch_tb_profiler", "hta"):
        out = subprocess.run([sys.executable, __file__, "--provider", provider, "--dir", trace_dir],
                             capture_output=True, text=True)
        if out.returncode != 0:
            rows[provider] = {"error": (out.stderr.strip().splitlines() or ["?"])[-1][:120]}
        else:
            rows[provider] = json.loads(out.stdout.strip().splitlines()[-1])
            rows[provider]["mb_per_s"] = total / 1e6 / rows[provider]["seconds"]
            rows[provider]["mb_per_cpu_s"] = total / 1e6 / rows[provider]["cpu_seconds"]
    for provider, row in rows.items():
        print(f"{provider:>18}: " + ", ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}"
                                               for k, v in row.items() if k != "overlap_pct"))
        if "overlap_pct" in row:
            print(f"{'':>18}  overlap % per rank: {[round(x, 3) for x in row['overlap_pct']]}")
    if "seconds" in rows.get("torch_tb_profiler", {}):
        print(f"meshkit speed-up vs torch-tb-profiler: "
              f"{rows['torch_tb_profiler']['seconds'] / rows['meshkit']['seconds']:.2f}x wall, "
              f"{rows['torch_tb_profiler']['cpu_seconds'] / rows['meshkit']['cpu_seconds']:.2f}x CPU time")


if __name__ == "__main__":
    main()
