"""The step-time model, communication/compute overlap and stragglers per rank and step.

**The step-time model.** Each wall-clock interval of each rank's profiled step belongs to exactly
one bucket, the first of this precedence that claims it (so the buckets sum to the step time by
construction, not by normalisation):

- CPU / gloo traces (the main thread's timeline, :data:`CPU_PRECEDENCE`): ``validation``,
  ``checkpoint`` (meshkit's ``meshkit:validation`` / ``meshkit:checkpoint`` spans), ``data_wait``
  (``enumerate(DataLoader)#*`` spans, and with meshkit's markers everything in the step outside
  forward+backward, optimizer, validation and checkpoint: fetching the batch and the loop's own
  work), ``bubble`` (outside ``PP:*`` actions, only where the trace has them), ``exposed_comm``
  (explicit wait ops such as ``_c10d_functional::wait_tensor`` anywhere, and inside
  forward+backward every moment a ``gloo:*`` collective of this rank is in flight while the main
  thread runs no operator: FSDP's and DDP's ``work.wait()`` is not an op, so this is how a
  blocked hook or autograd node shows), ``compute`` (operators inside forward+backward),
  ``optimizer`` (``meshkit:optimizer``, else torch's ``Optimizer.step#*`` / ``zero_grad#*``),
  ``other`` (the rest: Python between ops, a rank's own sleep).
- CUDA / NCCL traces (the device timeline, :data:`CUDA_PRECEDENCE`): ``exposed_comm`` (NCCL
  kernels not overlapped by compute kernels), ``compute`` (other kernels, except those launched
  in the optimizer phase), ``optimizer`` (those, and device idle while the host is in the
  optimizer phase), then device idle by what the host was doing: ``validation``, ``checkpoint``,
  ``data_wait``; ``other`` the rest (launch gaps, memcpy).

**Overlap** (HTA's definitions, per rank and step, from merged intervals):
``overlapped_comm = |compute ∩ comm|``, ``overlap_pct = 100 · overlapped_comm / comm``,
``exposed_comm = comm − overlapped_comm`` (this is comm not hidden by compute on the whole step,
which differs from the step model's blocked time), ``idle = window − |compute ∪ comm ∪ memory|``,
``bubble = window − |PP:* spans|``.

**Stragglers.** A collective instance is matched across ranks by when it *ends* (every member of
a process group leaves a collective together; the same name, overlapping, ends within
``max(1 ms, 5 %)``), so the groups (the member sets) come out of the trace itself, and the k-th
all-reduce of the TP group is never matched with one of the DP group. The member that started it
last arrived last, late by its start − the earliest start. The noise floor is the run's own
jitter: ``median + 8 · 1.4826 · MAD`` of every instance's lateness (with at least 10 instances,
else ``min_lateness_ms``). A rank waiting in a late instance waits for its last arrival, or, when
that rank was itself blocked in a late collective just before it arrived, for whoever that one
waited for (followed down the chain): ``waiting_for_ms`` per rank. A rank is named the straggler
when the waits it caused exceed twice the noise floor in every profiled step.

Example::

    >>> import json, tempfile, os
    >>> d = tempfile.mkdtemp()
    >>> ev = [{"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#0", "tid": 1, "ts": 0, "dur": 100},
    ...       {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "tid": 1, "ts": 0, "dur": 60},
    ...       {"ph": "X", "cat": "user_annotation", "name": "gloo:all_reduce", "tid": 2, "ts": 40, "dur": 40}]
    >>> with open(os.path.join(d, "rank0.pt.trace.json"), "w") as f:
    ...     json.dump({"distributedInfo": {"rank": 0, "world_size": 1}, "traceEvents": ev}, f)
    >>> r = analyze(d)["ranks"]["0"]
    >>> r["overlap_pct"], r["exposed_comm_ms"], r["idle_ms"], r["buckets_ms"]["exposed_comm"]
    (50.0, 0.02, 0.02, 0.02)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Sequence

import numpy as np

from meshkit.profiling.report import straggler_lines
from meshkit.profiling.trace import Intervals, RankTrace, TraceWindow, intersection_measure, load_windows

__all__ = ["CPU_PRECEDENCE", "CUDA_PRECEDENCE", "TRACE_BUCKETS", "step_claims", "step_buckets",
           "rank_step_metrics", "match_collectives", "noise_floor", "find_stragglers", "straggler_report", "analyze_window",
           "analyze", "format_table", "configure_parser", "run_cli"]

_US_PER_MS = 1000.0
CPU_PRECEDENCE = ("validation", "checkpoint", "data_wait", "bubble", "exposed_comm", "compute", "optimizer")
CUDA_PRECEDENCE = ("exposed_comm", "compute", "optimizer", "validation", "checkpoint", "data_wait")
TRACE_BUCKETS = ("compute", "exposed_comm", "bubble", "data_wait", "optimizer", "validation", "checkpoint",
                 "other")
"""The buckets a trace can tell (the remainder of a step is ``other``). MFUMonitor adds
``recompute`` (a share of compute) and ``profiler_overhead`` (its own time, outside any trace)."""
_EMPTY = Intervals(np.empty(0), np.empty(0))


# ------------------------------------------------------------------------------ step-time model


def _first_claims(order: Sequence[str], sets: dict[str, Intervals]) -> list[tuple[str, Intervals]]:
    """Each bucket keeps what no bucket before it in ``order`` claimed: disjoint sets."""
    claimed, out = _EMPTY, []
    for name in order:
        part = sets.get(name, _EMPTY).minus(claimed) if len(claimed) else sets.get(name, _EMPTY)
        out.append((name, part))
        claimed = Intervals.union_of(claimed, part)
    return out


def step_claims(rt: RankTrace) -> list[tuple[str, Intervals]]:
    """The step-time model of one rank: ``[(bucket, disjoint intervals)]`` in precedence order.

    Time inside a step window that no bucket claims is ``other``.
    """
    ph = rt.phases
    steps = Intervals.union(rt.step_windows[:, 0], rt.step_windows[:, 1]) if rt.step_windows.size else _EMPTY
    host = rt.host_steps if len(rt.host_steps) else steps
    marked = "forward_backward" in ph
    named = Intervals.union_of(*[ph[k] for k in ("forward_backward", "optimizer", "validation", "checkpoint")
                                 if k in ph]) if ph else _EMPTY
    data = ph.get("data_wait", _EMPTY)
    if marked:  # with meshkit's markers the rest of a step is the loop between batches
        data = Intervals.union_of(data, host.minus(named))
    if rt.shape == "cuda":
        sets = {"exposed_comm": rt.comm.minus(rt.compute), "compute": rt.compute.minus(rt.optimizer_kernels),
                "optimizer": Intervals.union_of(rt.optimizer_kernels, ph.get("optimizer", _EMPTY)),
                "validation": ph.get("validation", _EMPTY), "checkpoint": ph.get("checkpoint", _EMPTY),
                "data_wait": data}
        return _first_claims(CUDA_PRECEDENCE, sets)
    not_fb = Intervals.union_of(*[ph[k] for k in ("optimizer", "validation", "checkpoint") if k in ph], data) \
        if ph else data
    fb = ph["forward_backward"] if marked else steps.minus(not_fb)
    sets = {"validation": ph.get("validation", _EMPTY), "checkpoint": ph.get("checkpoint", _EMPTY),
            "data_wait": data, "bubble": fb.minus(rt.pipeline) if len(rt.pipeline) else _EMPTY,
            "exposed_comm": Intervals.union_of(rt.waits, rt.comm.minus(rt.compute).intersect(fb)),
            "compute": rt.compute.intersect(fb), "optimizer": ph.get("optimizer", _EMPTY)}
    return _first_claims(CPU_PRECEDENCE, sets)


def step_buckets(rt: RankTrace, claims: list[tuple[str, Intervals]] | None = None) -> dict[str, np.ndarray]:
    """Per-step µs in each of :data:`TRACE_BUCKETS`; per step they sum to the step window's length."""
    lo, hi = rt.step_windows[:, 0], rt.step_windows[:, 1]
    out = {name: part.measure(lo, hi) for name, part in (claims if claims is not None else step_claims(rt))}
    out["other"] = np.clip((hi - lo) - sum(out.values()), 0, None)
    return {k: out.get(k, np.zeros(lo.shape)) for k in TRACE_BUCKETS}


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


# ------------------------------------------------------------------------------------ stragglers


def match_collectives(ranks: dict[int, RankTrace]) -> list[dict[str, Any]]:
    """Collective instances across ranks, matched by their common end: ``[{"collective", "members":
    {rank: (start, end)}, "last", "lateness_ms"}]`` in start order (instances seen on one rank only
    are left out)."""
    spans = [(r, i, name, s, e) for r, rt in ranks.items() for i, (name, s, e, _) in enumerate(rt.collectives)]
    by_name: dict[str, list[tuple[int, int, float, float]]] = {}
    for r, i, name, s, e in spans:
        by_name.setdefault(name, []).append((r, i, s, e))
    instances = []
    for name, items in by_name.items():
        items.sort(key=lambda x: x[3])
        ends = np.array([x[3] for x in items])
        used: set[tuple[int, int]] = set()
        for r, i, s, e in items:
            if (r, i) in used:
                continue
            tol = max(1000.0, 0.05 * (e - s))
            members = {r: (s, e)}
            used.add((r, i))
            lo, hi = np.searchsorted(ends, e - tol), np.searchsorted(ends, e + tol, side="right")
            best: dict[int, tuple[float, int, float, float]] = {}
            for r2, i2, s2, e2 in items[lo:hi]:
                if r2 == r or (r2, i2) in used or s2 > e:
                    continue
                d = abs(e2 - e)
                if r2 not in best or d < best[r2][0]:
                    best[r2] = (d, i2, s2, e2)
            for r2, (_, i2, s2, e2) in best.items():
                members[r2] = (s2, e2)
                used.add((r2, i2))
            if len(members) > 1:
                starts = {m: v[0] for m, v in members.items()}
                last = max(starts, key=lambda m: (starts[m], m))
                instances.append({"collective": name, "members": members, "last": last,
                                  "lateness_ms": (starts[last] - min(starts.values())) / _US_PER_MS})
    instances.sort(key=lambda x: min(v[0] for v in x["members"].values()))
    return instances


def noise_floor(series: Sequence[Sequence[float]], *, k: float, minimum: float = 0.0, add_median: bool = False,
                min_samples: int = 2) -> float:
    """A run's own noise floor: ``max(minimum, [median] + k · jitter)``, the one home of the rule.

    ``jitter`` is the median over ``series`` of ``1.4826 · MAD(series)`` (a robust standard deviation);
    series shorter than ``min_samples`` are ignored, and with none left the floor is ``minimum``.
    ``add_median`` adds the median of the series' medians (a level, for lateness that is never 0).
    ``meshkit analyze`` uses one pooled series, ``k=8``, ``add_median=True``, ``min_samples=10``;
    the doctor per-rank series, ``k=JITTER_K`` and ``minimum=MIN_SHARE × step``.

    >>> noise_floor([[1.0, 2.0, 3.0]], k=2)  # MAD 1 -> 2 * 1.4826
    2.9652
    """
    kept = [np.asarray(s, dtype=float) for s in series if len(s) >= min_samples]
    if not kept:
        return minimum
    meds = [_median(s) for s in kept]
    jitter = _median([1.4826 * _median(np.abs(s - m)) for s, m in zip(kept, meds)])
    return max(minimum, (_median(meds) if add_median else 0.0) + k * jitter)


def _median(x: Any) -> float:
    """``np.median(x)``, the same value, without its first call importing ``numpy.ma`` (40 ms of CPU)."""
    s = np.sort(np.asarray(x, dtype=float))
    n = len(s)
    return float(s[n // 2]) if n % 2 else float((s[n // 2 - 1] + s[n // 2]) / 2)


def _root(inst: dict[str, Any], late: list[dict[str, Any]], blocked: dict[int, Intervals], depth: int = 0) -> int:
    """The rank a late instance really waited for: its last arrival, or, when that rank spent most of
    its lateness blocked in another late collective, whom it waited for there."""
    j = inst["last"]
    t = inst["members"][j][0]
    lo = t - inst["lateness_ms"] * _US_PER_MS
    if depth > 8 or j not in blocked or blocked[j].measure([lo], [t])[0] < 0.5 * (t - lo):
        return j
    overlap = [(min(x["members"][x["last"]][0], t) - max(x["members"][j][0], lo), x) for x in late
               if j in x["members"] and x["last"] != j and x is not inst]
    overlap = [(o, x) for o, x in overlap if o > 0.25 * (t - lo)]
    return j if not overlap else _root(max(overlap, key=lambda ox: ox[0])[1], late, blocked, depth + 1)


def straggler_report(ranks: dict[int, RankTrace], blocked: dict[int, Intervals] | None = None,
                     min_lateness_ms: float = 0.0) -> dict[str, Any]:
    """Who arrived last, per process group and collective, above the run's own jitter; and per rank,
    how long it waited for whom.

    ``blocked``: each rank's exposed-comm intervals (from :func:`step_claims`); waits count only
    where the rank was blocked. Returns ``{"stragglers": [...], "waiting_for_ms": {rank: {peer:
    ms}}, "straggler": {"rank", "caused_ms_per_step"} or None, "noise_floor_ms", "instances",
    "problems"}``.
    """
    problems: list[str] = []
    if len(ranks) < 2:
        return {"stragglers": [], "waiting_for_ms": {}, "straggler": None, "noise_floor_ms": min_lateness_ms,
                "instances": 0, "problems": problems}
    blocked = blocked or {}
    instances = match_collectives(ranks)
    floor = noise_floor([[x["lateness_ms"] for x in instances]], k=8, minimum=min_lateness_ms, add_median=True,
                        min_samples=10)
    late = [x for x in instances if x["lateness_ms"] > floor]
    groups: dict[tuple[str, tuple[int, ...]], list[dict[str, Any]]] = {}
    for x in instances:
        groups.setdefault((x["collective"], tuple(sorted(x["members"]))), []).append(x)
    table = []
    for (name, members), xs in sorted(groups.items()):
        xl = [x for x in xs if x["lateness_ms"] > floor]
        if not xl:
            continue
        counts = {m: sum(x["last"] == m for x in xl) for m in members}
        totals = {m: sum(x["lateness_ms"] for x in xl if x["last"] == m) for m in members}
        worst = max(members, key=lambda m: (counts[m], totals[m]))
        mine = [x["lateness_ms"] for x in xl if x["last"] == worst]
        table.append({"collective": name, "group": list(members), "rank": int(worst),
                      "lateness_ms": round(float(np.mean(mine)), 6), "max_lateness_ms": round(float(max(mine)), 6),
                      "times_last": int(counts[worst]), "instances": len(xs)})
    table.sort(key=lambda d: -d["lateness_ms"] * d["times_last"])
    waits: dict[int, dict[int, list[tuple[float, float]]]] = {}
    for x in late:
        root = _root(x, late, blocked)
        t_last = x["members"][x["last"]][0]
        for r, (s, _) in x["members"].items():
            if r != x["last"] and r != root:
                waits.setdefault(r, {}).setdefault(root, []).append((s, t_last))
    waiting_for: dict[int, dict[int, float]] = {}
    for r, per_root in waits.items():
        for root, ivs in per_root.items():
            u = Intervals.union([a for a, _ in ivs], [b for _, b in ivs])
            if r in blocked:
                u = u.intersect(blocked[r])
            if u.total > 0:
                waiting_for.setdefault(r, {})[root] = round(u.total / _US_PER_MS, 6)
    verdict = _verdict(ranks, waits, blocked, floor)
    return {"stragglers": table, "waiting_for_ms": waiting_for, "straggler": verdict,
            "noise_floor_ms": round(floor, 6), "instances": len(instances), "problems": problems}


def _verdict(ranks: dict[int, RankTrace], waits: dict[int, dict[int, list[tuple[float, float]]]],
             blocked: dict[int, Intervals], floor: float) -> dict[str, Any] | None:
    """The rank whose late arrivals made others wait beyond the noise floor in every profiled step."""
    best = None
    for root in {root for per_root in waits.values() for root in per_root}:
        per_step = []
        for r, per_root in waits.items():
            ivs = per_root.get(root, [])
            u = Intervals.union([a for a, _ in ivs], [b for _, b in ivs])
            u = u.intersect(blocked[r]) if r in blocked else u
            sw = ranks[r].step_windows
            per_step.append(u.measure(sw[:, 0], sw[:, 1]) / _US_PER_MS)
        worst = np.max(np.stack(per_step), axis=0) if per_step else np.zeros(0)
        if worst.size and float(worst.min()) > 2 * max(floor, 0.0) and (best is None or worst.mean() > best[1]):
            best = (root, float(worst.mean()))
    return None if best is None else {"rank": int(best[0]), "caused_ms_per_step": round(best[1], 6)}


def find_stragglers(ranks: dict[int, RankTrace], min_lateness_ms: float = 0.0) -> tuple[list[dict], list[str]]:
    """Per process group and collective, the rank most often last above the noise floor (see
    :func:`straggler_report`): ``([{"collective", "group", "rank", "lateness_ms",
    "max_lateness_ms", "times_last", "instances"}], problems)``, worst first."""
    rep = straggler_report(ranks, None, min_lateness_ms)
    return rep["stragglers"], rep["problems"]


# -------------------------------------------------------------------------------------- analysis


def _timeline_bubbles(logdir: str) -> dict[int, dict[str, float]]:
    from meshkit.timeline import find_timeline_dir, read_timeline

    tdir = find_timeline_dir(logdir)
    if tdir is None:
        return {}
    from meshkit.profiling.bubble import measured_bubble  # only for a pipeline run (it has a timeline)

    records = read_timeline(tdir)
    return {r: {"bubble_ms": m.idle_ns / 1e6, "bubble_fraction": m.bubble_fraction}
            for r, m in measured_bubble(records).per_rank.items()}


def _ms(x: Any) -> float:
    return round(float(np.sum(x)) / _US_PER_MS, 6)


def _rank_entry(rt: RankTrace, claims: list[tuple[str, Intervals]]) -> dict[str, Any]:
    m = rank_step_metrics(rt)
    b = step_buckets(rt, claims)
    tot = {k: _ms(v) for k, v in m.items()}
    entry: dict[str, Any] = {
        "steps": int(rt.step_windows.shape[0]), "compute_ms": tot["compute"], "comm_ms": tot["comm"],
        "overlapped_comm_ms": tot["overlapped_comm"], "exposed_comm_ms": tot["exposed_comm"], "idle_ms": tot["idle"],
        "overlap_pct": round(100.0 * tot["overlapped_comm"] / tot["comm"], 4) if tot["comm"] > 0 else 0.0,
        "memory_ms": tot["memory"], "wall_ms": tot["wall"], "shape": rt.shape, "partial": rt.partial,
        "buckets_ms": {k: _ms(v) for k, v in b.items()}, "bad_events": sum(f["count"] for f in rt.bad_events),
    }
    if "bubble" in tot:
        entry["bubble_ms"] = tot["bubble"]
    if rt.peak is not None:
        entry["peak"] = rt.peak
    ms = lambda v: [round(x / _US_PER_MS, 6) for x in v.tolist()]  # noqa: E731 (tolist: the same floats)
    m_ms, b_ms = {f"{k}_ms": ms(v) for k, v in m.items()}, {k: ms(v) for k, v in b.items()}
    entry["per_step"] = [
        {"step": int(s), **{k: v[i] for k, v in m_ms.items()}, "buckets_ms": {k: v[i] for k, v in b_ms.items()}}
        for i, s in enumerate(rt.step_ids.tolist())
    ]
    return entry


def analyze_window(ranks: dict[int, RankTrace], *, min_lateness_ms: float = 0.0) -> dict[str, Any]:
    """One profiler window's analysis from already loaded :class:`RankTrace` s (see :func:`analyze`)."""
    claims = {r: step_claims(rt) for r, rt in ranks.items()}
    out = {str(r): _rank_entry(rt, claims[r]) for r, rt in ranks.items()}
    blocked = {r: dict(c)["exposed_comm"] for r, c in claims.items()}
    rep = straggler_report(ranks, blocked, min_lateness_ms)
    for r, per_root in rep["waiting_for_ms"].items():
        out[str(r)]["waiting_for_ms"] = {str(k): v for k, v in sorted(per_root.items())}
    problems = [f"rank {r}: {p}" for r, rt in ranks.items() for p in rt.problems] + rep["problems"]
    return {"ranks": out, "stragglers": rep["stragglers"], "straggler": rep["straggler"],
            "noise_floor_ms": rep["noise_floor_ms"], "problems": problems}


def _sum_entries(entries: list[dict[str, Any]]) -> dict[str, Any]:
    total = dict(entries[0])
    for e in entries[1:]:
        for k, v in e.items():
            if k.endswith("_ms") and isinstance(v, float):
                total[k] = round(total.get(k, 0.0) + v, 6)
            elif k in ("buckets_ms", "waiting_for_ms"):
                total[k] = {n: round(total.get(k, {}).get(n, 0.0) + x, 6) for n, x in
                            {**dict.fromkeys(total.get(k, {}), 0.0), **v}.items()}
        total["steps"] = total["steps"] + e["steps"]
        total["bad_events"] = total["bad_events"] + e["bad_events"]
        total["per_step"] = total["per_step"] + e["per_step"]
        total["partial"] = total["partial"] or e["partial"]
    c = total["comm_ms"]
    total["overlap_pct"] = round(100.0 * total["overlapped_comm_ms"] / c, 4) if c > 0 else 0.0
    return total


def analyze(logdir: str | Sequence[str], *, min_lateness_ms: float = 0.0) -> dict[str, Any]:
    """Analyse every profiler window of every rank under ``logdir`` (a directory, or a list of files).

    Returns ``{"ranks": {"<rank>": {"steps", "compute_ms", "comm_ms", "overlapped_comm_ms",
    "exposed_comm_ms", "idle_ms", "overlap_pct", "memory_ms", "wall_ms", "shape", "buckets_ms",
    ["bubble_ms", "waiting_for_ms"], "per_step": [...]}}, "windows": [{"key", "ranks", "stragglers",
    "straggler", "noise_floor_ms"}], "windows_used": [...], "stragglers": [...], "straggler",
    "partial", "problems", "missing_ranks", "bad_events"}``. ``ranks`` sums every window (each step in
    ``per_step`` names its window); times are sums over the profiled steps. A truncated, corrupt or
    missing input sets ``partial`` and says why in ``problems``. Complete events with a bad ``ts`` /
    ``dur`` / correlation (a string, a negative or missing ``dur``: ``trace.BAD_EVENT_REASONS``) are
    skipped and listed in ``bad_events`` (per rank, window and file: ``count``, ``complete``,
    ``reasons``, ``first``, ``message``; ``bad_events`` per rank counts them) and set ``partial``.
    A directory with nothing usable, or a file whose events are all bad, raises ``ValueError``.
    """
    if not (isinstance(min_lateness_ms, (int, float)) and min_lateness_ms >= 0):
        raise ValueError(f"analyze: `min_lateness_ms={min_lateness_ms!r}` must be a number >= 0 (0: the run's own "
                         "noise floor decides).")
    windows, problems = load_windows(logdir)
    windows = [w for w in windows if w.ranks]
    try:
        timeline = _timeline_bubbles(logdir) if isinstance(logdir, str) and os.path.isdir(logdir) else {}
    except ValueError as exc:
        timeline, problems = {}, problems + [f"pipeline timeline: {exc}"]
    per_window = []
    for w in windows:
        res = analyze_window(w.ranks, min_lateness_ms=min_lateness_ms)
        for entry in res["ranks"].values():
            for st in entry["per_step"]:
                st["window"] = w.key
        problems.extend(f"window {w.key}: {p}" for p in res["problems"])
        per_window.append({"key": w.key, **{k: res[k] for k in ("ranks", "stragglers", "straggler",
                                                                  "noise_floor_ms")}, "missing_ranks": w.missing})
    ranks: dict[str, Any] = {}
    for r in sorted({int(r) for pw in per_window for r in pw["ranks"]}):
        ranks[str(r)] = _sum_entries([pw["ranks"][str(r)] for pw in per_window if str(r) in pw["ranks"]])
        if r in timeline:
            ranks[str(r)]["timeline_bubble_ms"] = round(timeline[r]["bubble_ms"], 6)
            ranks[str(r)]["timeline_bubble_fraction"] = round(timeline[r]["bubble_fraction"], 6)
    missing = sorted({r for w in windows for r in w.missing})
    verdicts = [pw["straggler"] for pw in per_window if pw["straggler"]]
    straggler = max(verdicts, key=lambda v: v["caused_ms_per_step"]) if verdicts else None
    partial = bool(missing) or any(v["partial"] for v in ranks.values()) or any(
        "nothing usable" in p or "skipped" in p for p in problems)
    return {
        "ranks": ranks, "windows": per_window, "windows_used": [w.key for w in windows],
        "stragglers": [dict(s, window=pw["key"]) for pw in per_window for s in pw["stragglers"]],
        "straggler": straggler, "partial": partial, "problems": problems, "missing_ranks": missing,
        "bad_events": [{"window": w.key, "rank": r, **b, "message": f"rank {r}, window {w.key}: {b['message']}"}
                       for w in windows for r, rt in sorted(w.ranks.items()) for b in rt.bad_events],
        "trace_bytes": int(sum(rt.bytes for w in windows for rt in w.ranks.values())),
        "events": int(sum(rt.events for w in windows for rt in w.ranks.values())),
    }


def format_table(result: dict[str, Any]) -> str:
    """A fixed-width text table of :func:`analyze`'s result (the CLI's default output).

    Every time is a total over the profiled steps of the windows used (the first line says which), in the
    unit its column names (``_ms``, ``_pct``); ``steps`` counts those steps.
    """
    cols = ["steps", "compute_ms", "comm_ms", "overlapped_comm_ms", "exposed_comm_ms", "idle_ms", "overlap_pct"]
    has_bubble = any("bubble_ms" in v for v in result["ranks"].values())
    if has_bubble:
        cols.append("bubble_ms")
    used = result.get("windows_used", [])
    scope = f"totals over each rank's profiled steps, profiler windows {used} (keyed by first batch)"
    bad = result.get("bad_events", [])
    lines = [f"warning: skipped bad trace events: {b['message']}" for b in bad]
    lines += [f"per rank, ms and % ({scope}; overlap_pct = overlapped / all comm):",
             "rank " + " ".join(f"{c:>18}" for c in cols)]
    for r, v in result["ranks"].items():
        lines.append(f"{r:>4} " + " ".join(f"{v.get(c, float('nan')):>18.3f}" if c != "steps" else f"{v[c]:>18d}"
                                            for c in cols))
    names = list(next(iter(result["ranks"].values()), {}).get("buckets_ms", {}))
    if names:
        lines += ["", "step model, ms summed over the same steps (each step's time in exactly one bucket):",
                  "rank " + " ".join(f"{n:>13}" for n in names) + "  waiting for"]
        for r, v in result["ranks"].items():
            waits = ", ".join(f"rank {k} {x:.3f} ms" for k, x in v.get("waiting_for_ms", {}).items()) or "-"
            lines.append(f"{r:>4} " + " ".join(f"{v['buckets_ms'][n]:>13.3f}" for n in names) + f"  {waits}")
    lines.append("")
    lines.append(f"windows used (first batch): {result.get('windows_used', [])}")
    peaks = {json.dumps(v["peak"], sort_keys=True) for v in result["ranks"].values() if "peak" in v}
    for peak in sorted(peaks):
        p = json.loads(peak)
        lines.append(f"peak FLOP/s used by MFUMonitor: {p.get('flops', 0):.4g} ({p.get('source', '?')})")
    lines.extend(straggler_lines(result, max_rows=10))
    if result["partial"]:
        lines.append("")
        lines.append("PARTIAL RESULT:")
        shown = [b["message"].split(": ", 1)[1] for b in bad]  # the warnings above: not twice
        lines.extend(f"  - {p}" for p in result["problems"] if not any(p.endswith(m) for m in shown))
        if bad:
            lines.append(f"  - {sum(b['count'] for b in bad)} bad events skipped (the warnings at the top)")
    return "\n".join(lines)


def configure_parser(parser: argparse.ArgumentParser) -> None:
    """``meshkit analyze LOGDIR [--json]``."""
    parser.add_argument("logdir", help="directory with torch.profiler traces (*.pt.trace.json[.gz]) of all ranks")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("--min-lateness-ms", type=float, default=0.0,
                        help="ignore collective instances whose ranks arrived within this many ms")


def run_cli(args: argparse.Namespace) -> int:
    result = analyze(args.logdir, min_lateness_ms=args.min_lateness_ms)  # ValueError: meshkit.cli, exit 2
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print(format_table(result))
    if result["partial"]:
        n_bad = sum(b["count"] for b in result["bad_events"])
        print(f"meshkit analyze: warning: partial result ({len(result['problems'])} problems"
              + (f"; {n_bad} bad trace events skipped" if n_bad else "") + ")", file=sys.stderr)
    return 0


if __name__ == "__main__":  # a library module, not a command: it names its verb and exits 2
    from meshkit.verbs import not_a_command

    not_a_command("meshkit.profiling.overlap")
