"""Communication/compute overlap, exposed communication, idle time and stragglers per rank and step.

Definitions (per rank, per step window; all from merged intervals, so nested or concurrent
events are never counted twice):

- ``compute``: time covered by compute (kernels, or aten ops on the training thread on CPU).
- ``comm``: time covered by communication (NCCL kernels, or ``gloo:*`` spans).
- ``overlapped_comm = |compute ∩ comm|``; ``overlap_pct = 100 · overlapped_comm / comm``
  (Holistic Trace Analysis' definition); ``exposed_comm = comm − overlapped_comm``.
- ``idle``: window length minus the time covered by compute, comm or memory operations.
- ``bubble``: window length minus the time covered by ``PP:*`` pipeline actions (only when the
  run recorded them); the timeline-record bubble comes from :mod:`meshkit.profiling.bubble`.
- stragglers: the k-th instance of a collective on every rank is one collective; the rank whose
  instance started last "arrived" last, late by (its start − the earliest start).

Example::

    >>> import json, tempfile, os
    >>> d = tempfile.mkdtemp()
    >>> ev = [{"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#0", "tid": 1, "ts": 0, "dur": 100},
    ...       {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "tid": 1, "ts": 0, "dur": 60},
    ...       {"ph": "X", "cat": "user_annotation", "name": "gloo:all_reduce", "tid": 2, "ts": 40, "dur": 40}]
    >>> with open(os.path.join(d, "rank0.pt.trace.json"), "w") as f:
    ...     json.dump({"distributedInfo": {"rank": 0, "world_size": 1}, "traceEvents": ev}, f)
    >>> r = analyze(d)["ranks"]["0"]
    >>> r["overlap_pct"], r["exposed_comm_ms"], r["idle_ms"]
    (50.0, 0.02, 0.02)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Sequence

import numpy as np

from meshkit.profiling.trace import Intervals, RankTrace, intersection_measure, load_rank_traces

__all__ = ["rank_step_metrics", "find_stragglers", "analyze", "format_table", "configure_parser", "run_cli"]

_US_PER_MS = 1000.0


def rank_step_metrics(rt: RankTrace) -> dict[str, np.ndarray]:
    """Per-step arrays (µs) for one rank: compute, comm, overlapped_comm, exposed_comm, memory, idle, wall, bubble."""
    lo, hi = rt.step_windows[:, 0], rt.step_windows[:, 1]
    compute = rt.compute.measure(lo, hi)
    comm = rt.comm.measure(lo, hi)
    overlapped = np.clip(intersection_measure(rt.compute, rt.comm, lo, hi), 0, None)
    busy = Intervals.union_of(rt.compute, rt.comm, rt.memory).measure(lo, hi)
    wall = hi - lo
    out = {
        "wall": wall, "compute": compute, "comm": comm, "overlapped_comm": overlapped,
        "exposed_comm": np.clip(comm - overlapped, 0, None), "memory": rt.memory.measure(lo, hi),
        "idle": np.clip(wall - busy, 0, None),
    }
    if len(rt.pipeline):
        out["bubble"] = np.clip(wall - rt.pipeline.measure(lo, hi), 0, None)
    return out


def find_stragglers(ranks: dict[int, RankTrace], min_lateness_ms: float = 0.0) -> tuple[list[dict], list[str]]:
    """Match the k-th instance of each collective across ranks and say who arrived last.

    Returns one entry per collective name, worst first: ``{"collective", "rank"`` (the rank most
    often last, ties to the larger total lateness), ``"lateness_ms"`` (its mean lateness when
    last), ``"max_lateness_ms"``, ``"times_last"``, ``"instances"}``; and problems (count mismatches).
    """
    problems: list[str] = []
    if len(ranks) < 2:
        return [], problems
    by_name: dict[str, dict[int, list[float]]] = {}
    for r, rt in ranks.items():
        for name, start, _ in rt.collectives:
            by_name.setdefault(name, {}).setdefault(r, []).append(start)
    result = []
    for name, starts in sorted(by_name.items()):
        present = sorted(starts)
        if len(present) < 2:
            continue
        counts = {r: len(v) for r, v in starts.items()}
        n = min(counts.values())
        if len(set(counts.values())) > 1:
            problems.append(f"collective {name}: instance counts differ across ranks {counts}; matched the first {n}")
        if len(present) < len(ranks):
            problems.append(f"collective {name}: seen on ranks {present} only")
        arrivals = np.array([starts[r][:n] for r in present])  # (R, n)
        last = arrivals.argmax(axis=0)
        lateness = (arrivals.max(axis=0) - arrivals.min(axis=0)) / _US_PER_MS
        late = lateness > min_lateness_ms
        if not late.any():
            continue
        times_last = np.bincount(last[late], minlength=len(present))
        total_late = np.bincount(last[late], weights=lateness[late], minlength=len(present))
        worst = max(range(len(present)), key=lambda i: (times_last[i], total_late[i]))
        mine = late & (last == worst)
        result.append({
            "collective": name, "rank": int(present[worst]),
            "lateness_ms": round(float(lateness[mine].mean()), 6),
            "max_lateness_ms": round(float(lateness[mine].max()), 6),
            "times_last": int(times_last[worst]), "instances": int(n),
        })
    result.sort(key=lambda d: -d["lateness_ms"] * d["times_last"])
    return result, problems


def _timeline_bubbles(logdir: str) -> dict[int, dict[str, float]]:
    from meshkit.profiling.bubble import find_timeline_dir, measured_bubble, read_timeline

    tdir = find_timeline_dir(logdir)
    if tdir is None:
        return {}
    records = read_timeline(tdir)
    return {r: {"bubble_ms": m.idle_ns / 1e6, "bubble_fraction": m.bubble_fraction}
            for r, m in measured_bubble(records).per_rank.items()}


def analyze(logdir: str | Sequence[str], *, min_lateness_ms: float = 0.0) -> dict[str, Any]:
    """Analyse every rank's torch.profiler traces under ``logdir`` (a directory, or a list of files).

    Returns ``{"ranks": {"<rank>": {"steps", "compute_ms", "comm_ms", "overlapped_comm_ms",
    "exposed_comm_ms", "idle_ms", "overlap_pct", "memory_ms", "wall_ms", "shape",
    ["bubble_ms"], "per_step": [...]}}, "stragglers": [...], "partial": bool, "problems": [...],
    "missing_ranks": [...]}``. Times are sums over the rank's profiled steps. A truncated,
    corrupt or missing input sets ``partial`` and says why in ``problems``; a directory with
    nothing usable raises ``ValueError``.
    """
    ranks, problems, missing = load_rank_traces(logdir)
    out_ranks: dict[str, Any] = {}
    try:
        timeline = _timeline_bubbles(logdir) if isinstance(logdir, str) and os.path.isdir(logdir) else {}
    except ValueError as exc:
        timeline, problems = {}, problems + [f"pipeline timeline: {exc}"]
    for r, rt in ranks.items():
        m = rank_step_metrics(rt)
        tot = {k: float(v.sum()) / _US_PER_MS for k, v in m.items()}
        entry: dict[str, Any] = {
            "steps": int(rt.step_windows.shape[0]),
            "compute_ms": round(tot["compute"], 6),
            "comm_ms": round(tot["comm"], 6),
            "overlapped_comm_ms": round(tot["overlapped_comm"], 6),
            "exposed_comm_ms": round(tot["exposed_comm"], 6),
            "idle_ms": round(tot["idle"], 6),
            "overlap_pct": round(100.0 * tot["overlapped_comm"] / tot["comm"], 4) if tot["comm"] > 0 else 0.0,
            "memory_ms": round(tot["memory"], 6),
            "wall_ms": round(tot["wall"], 6),
            "shape": rt.shape,
            "partial": rt.partial,
        }
        if "bubble" in tot:
            entry["bubble_ms"] = round(tot["bubble"], 6)
        if r in timeline:
            entry["timeline_bubble_ms"] = round(timeline[r]["bubble_ms"], 6)
            entry["timeline_bubble_fraction"] = round(timeline[r]["bubble_fraction"], 6)
        entry["per_step"] = [
            {"step": int(s), **{f"{k}_ms": round(float(v[i]) / _US_PER_MS, 6) for k, v in m.items()}}
            for i, s in enumerate(rt.step_ids)
        ]
        out_ranks[str(r)] = entry
        problems.extend(f"rank {r}: {p}" for p in rt.problems)
    stragglers, sprobs = find_stragglers(ranks, min_lateness_ms)
    problems.extend(sprobs)
    partial = bool(missing) or any(rt.partial for rt in ranks.values()) or any(
        "nothing usable" in p or "skipped" in p for p in problems)
    return {
        "ranks": out_ranks, "stragglers": stragglers, "partial": partial, "problems": problems,
        "missing_ranks": missing, "trace_bytes": int(sum(rt.bytes for rt in ranks.values())),
        "events": int(sum(rt.events for rt in ranks.values())),
    }


def format_table(result: dict[str, Any]) -> str:
    """A fixed-width text table of :func:`analyze`'s result (the CLI's default output)."""
    cols = ["steps", "compute_ms", "comm_ms", "overlapped_comm_ms", "exposed_comm_ms", "idle_ms", "overlap_pct"]
    has_bubble = any("bubble_ms" in v for v in result["ranks"].values())
    if has_bubble:
        cols.append("bubble_ms")
    lines = ["rank " + " ".join(f"{c:>18}" for c in cols)]
    for r, v in result["ranks"].items():
        lines.append(f"{r:>4} " + " ".join(f"{v.get(c, float('nan')):>18.3f}" if c != "steps" else f"{v[c]:>18d}"
                                            for c in cols))
    if result["stragglers"]:
        lines.append("")
        lines.append("stragglers (rank most often last per collective):")
        for s in result["stragglers"][:10]:
            lines.append(f"  {s['collective']:<32} rank {s['rank']:>3}  late by {s['lateness_ms']:.3f} ms "
                         f"(last in {s['times_last']}/{s['instances']})")
    if result["partial"]:
        lines.append("")
        lines.append("PARTIAL RESULT:")
        lines.extend(f"  - {p}" for p in result["problems"])
    return "\n".join(lines)


def configure_parser(parser: argparse.ArgumentParser) -> None:
    """``meshkit analyze LOGDIR [--json]``."""
    parser.add_argument("logdir", help="directory with torch.profiler traces (*.pt.trace.json[.gz]) of all ranks")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("--min-lateness-ms", type=float, default=0.0,
                        help="ignore collective instances whose ranks arrived within this many ms")


def run_cli(args: argparse.Namespace) -> int:
    try:
        result = analyze(args.logdir, min_lateness_ms=args.min_lateness_ms)
    except ValueError as exc:
        print(f"meshkit analyze: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print(format_table(result))
    if result["partial"]:
        print(f"meshkit analyze: warning: partial result ({len(result['problems'])} problems)", file=sys.stderr)
    return 0


if __name__ == "__main__":  # pragma: no cover
    p = argparse.ArgumentParser(prog="meshkit analyze")
    configure_parser(p)
    raise SystemExit(run_cli(p.parse_args()))
