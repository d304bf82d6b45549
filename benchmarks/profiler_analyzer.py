"""Analyzer throughput: `meshkit analyze` vs torch-tb-profiler's loader (and HTA where installed)
on one synthetic multi-rank trace directory of >= 100 MB (Kineto layout, CPU/gloo shape).

Each provider runs in a fresh subprocess: wall time, CPU time (MB per CPU-second is the
per-core throughput, robust to a loaded machine) and peak RSS:

    python benchmarks/profiler_analyzer.py --mb 100 --ranks 4
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


def write_rank(path: str, rank: int, world: int, target_bytes: int) -> int:
    """One rank's trace: steps of 200 aten ops on the main thread and 4 gloo collectives on a worker."""
    with open(path, "w") as f:
        f.write('{\n  "schemaVersion": 1,\n  "distributedInfo": ' + json.dumps({"backend": "gloo", "rank": rank,
                "world_size": world}) + ',\n  "traceEvents": [\n')
        first, ts, step, n = True, 1_000_000.0, 0, 0
        while f.tell() < target_bytes:
            events = [{"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{step}", "pid": 1, "tid": 1,
                       "ts": ts, "dur": 2000.0, "args": {"External id": n}}]
            for i in range(200):
                events.append({"ph": "X", "cat": "cpu_op", "name": "aten::mm" if i % 3 else "aten::add", "pid": 1,
                               "tid": 1, "ts": ts + 8 * i, "dur": 6.5, "args": {"External id": n + i,
                               "Record function id": 0, "Sequence number": n + i, "Fwd thread id": 0}})
            for c in range(4):
                events.append({"ph": "X", "cat": "user_annotation", "name": "gloo:all_reduce", "pid": 1, "tid": 2,
                               "ts": ts + 400 * c + 13 * rank, "dur": 300.0, "args": {"External id": n + 300 + c}})
            for e in events:
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
        detail = {"ranks": len(result["ranks"]), "partial": result["partial"]}
    elif provider == "torch_tb_profiler":
        cache = tempfile.mkdtemp()
        for path in files:
            worker = os.path.basename(path).split(".")[0]
            RunProfileData.parse(worker, None, path, cache)
        detail = {"files": len(files)}
    else:
        TraceAnalysis(trace_dir=trace_dir).get_comm_comp_overlap()
        detail = {}
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
            total += write_rank(path, r, args.ranks, int(args.mb * 1e6 / args.ranks))
    print(f"trace directory {trace_dir}: {args.ranks} ranks, {total / 1e6:.1f} MB")
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
                                               for k, v in row.items()))
    if "seconds" in rows.get("torch_tb_profiler", {}):
        print(f"meshkit speed-up vs torch-tb-profiler: "
              f"{rows['torch_tb_profiler']['seconds'] / rows['meshkit']['seconds']:.2f}x wall, "
              f"{rows['torch_tb_profiler']['cpu_seconds'] / rows['meshkit']['cpu_seconds']:.2f}x CPU time")


if __name__ == "__main__":
    main()
