"""The step-time model, communication/compute overlap and stragglers per rank and step.

**The step-time model.** Each wall-clock interval of each rank's profiled step belongs to exactly
one bucket, the first of this precedence that claims it (so the buckets sum to the step time by
construction, not by normalisation):

- CPU / gloo traces (the main thread's timeline, :data:`CPU_PRECEDENCE`): ``validation``,
  ``checkpoint`` (meshkit's ``meshkit:validation`` / ``meshkit:checkpoint`` spans), ``data_wait``
  (``enumerate(DataLoader)#*`` spans, and with meshkit's markers everything in the step outside
  forward+backward, optimizer, validation, checkpoint and the stop signal: fetching the batch and the
  loop's own work), ``bubble`` (outside ``PP:*`` actions, only where the trace has them), ``exposed_comm``
  (explicit wait ops such as ``_c10d_functional::wait_tensor`` anywhere, and inside
  forward+backward every moment a ``gloo:*`` collective of this rank is in flight while the main
  thread runs no operator: FSDP's and DDP's ``work.wait()`` is not an op, so this is how a
  blocked hook or autograd node shows; the main thread inside a collective call such as
  ``c10d::allreduce_`` outside its operators, which on a loaded host outlasts the collective's own
  span; and ``meshkit:stop_signal``, Lightning's per-batch stop-signal
  broadcast, where a rank waits for the slowest between batches), ``compute`` (operators inside forward+backward),
  ``optimizer`` (``meshkit:optimizer``, else torch's ``Optimizer.step#*`` / ``zero_grad#*``),
  ``other`` (the rest: Python between ops, a rank's own sleep).
- CUDA / NCCL traces (the device timeline, :data:`CUDA_PRECEDENCE`): ``exposed_comm`` (NCCL
  kernels not overlapped by compute kernels, and the host's stop-signal wait not overlapped by them),
  ``compute`` (other kernels, except those launched
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
``max(1 ms, 5 %)`` of the longer span), so the groups (the member sets) come out of the trace itself, and the k-th
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

from meshkit.profiling.report import HOST_OTHER_PARTS, straggler_lines, waterfall
from meshkit.profiling.trace import Intervals, RankTrace, TraceWindow, intersection_measure, load_windows

__all__ = ["CPU_PRECEDENCE", "CUDA_PRECEDENCE", "TRACE_BUCKETS", "step_claims", "step_buckets",
           "rank_step_metrics", "compute_split", "host_other_split", "group_axes", "thread_groups",
           "exposed_comm_by_axis", "run_peak", "add_waterfall", "match_collectives", "noise_floor",
           "straggler_report", "analyze_window", "analyze", "format_analysis", "configure_parser", "run_cli"]

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
    named = Intervals.union_of(*[ph[k] for k in ("forward_backward", "optimizer", "validation", "checkpoint",
                                                 "stop_signal") if k in ph]) if ph else _EMPTY
    stop = ph.get("stop_signal", _EMPTY)  # waiting in the stop-signal broadcast between batches: exposed comm
    data = ph.get("data_wait", _EMPTY)
    if marked:  # with meshkit's markers the rest of a step is the loop between batches
        data = Intervals.union_of(data, host.minus(named))
    if rt.shape == "cuda":
        sets = {"exposed_comm": Intervals.union_of(rt.comm, stop).minus(rt.compute),
                "compute": rt.compute.minus(rt.optimizer_kernels),
                "optimizer": Intervals.union_of(rt.optimizer_kernels, ph.get("optimizer", _EMPTY)),
                "validation": ph.get("validation", _EMPTY), "checkpoint": ph.get("checkpoint", _EMPTY),
                "data_wait": data}
        return _first_claims(CUDA_PRECEDENCE, sets)
    not_fb = Intervals.union_of(*[ph[k] for k in ("optimizer", "validation", "checkpoint") if k in ph], data) \
        if ph else data
    fb = ph["forward_backward"] if marked else steps.minus(not_fb)
    sets = {"validation": ph.get("validation", _EMPTY), "checkpoint": ph.get("checkpoint", _EMPTY),
            "data_wait": data, "bubble": fb.minus(rt.pipeline) if len(rt.pipeline) else _EMPTY,
            "exposed_comm": Intervals.union_of(rt.waits, Intervals.union_of(rt.comm, rt.comm_calls).minus(
                rt.compute).intersect(fb), stop),
            "compute": rt.compute.intersect(fb), "optimizer": ph.get("optimizer", _EMPTY)}
    return _first_claims(CPU_PRECEDENCE, sets)


def step_buckets(rt: RankTrace, claims: list[tuple[str, Intervals]] | None = None) -> dict[str, np.ndarray]:
    """Per-step µs in each of :data:`TRACE_BUCKETS`; per step they sum to the step window's length."""
    lo, hi = rt.step_windows[:, 0], rt.step_windows[:, 1]
    out = {name: part.measure(lo, hi) for name, part in (claims if claims is not None else step_claims(rt))}
    out["other"] = np.clip((hi - lo) - sum(out.values()), 0, None)
    return {k: out.get(k, np.zeros(lo.shape)) for k in TRACE_BUCKETS}


def compute_split(rt: RankTrace, claims: list[tuple[str, Intervals]]) -> dict[str, np.ndarray]:
    """Per-step µs of the ``compute`` bucket by class (:data:`meshkit.profiling.trace.COMPUTE_CLASSES`):
    ``attention``, ``matmul`` (outside attention) and ``non_matmul`` (the rest); they sum to the bucket."""
    lo, hi = rt.step_windows[:, 0], rt.step_windows[:, 1]
    compute = dict(claims).get("compute", _EMPTY)
    if rt.shape == "cuda":  # the claim is every compute kernel but the optimizer's (exposed comm is outside them)
        within = lambda part: part.minus(rt.optimizer_kernels)  # noqa: E731 (a class's kernels are compute)
    else:
        within = lambda part: part.intersect(compute)  # noqa: E731
    att = within(rt.compute_classes.get("attention", _EMPTY))
    mm = within(rt.compute_classes.get("matmul", _EMPTY)).minus(att)
    out = {"attention": att.measure(lo, hi), "matmul": mm.measure(lo, hi)}
    out["non_matmul"] = np.clip(compute.measure(lo, hi) - out["attention"] - out["matmul"], 0, None)
    return out


def host_other_split(rt: RankTrace, claims: list[tuple[str, Intervals]]) -> dict[str, np.ndarray]:
    """Per-step µs of the ``other`` bucket by :data:`meshkit.profiling.report.HOST_OTHER_PARTS` (first claim
    wins; ``unexplained`` is the rest, so the parts sum to the bucket)."""
    lo, hi = rt.step_windows[:, 0], rt.step_windows[:, 1]
    steps = Intervals.union(lo, hi)
    # the claims are disjoint: their boundaries go to one sweep as they are, unmerged (minus counts cover)
    claimed = Intervals(np.concatenate([p.starts for _, p in claims]), np.concatenate([p.ends for _, p in claims])) \
        if claims else _EMPTY
    other = steps.minus(claimed)
    fb = rt.phases.get("forward_backward") or (rt.host_steps if len(rt.host_steps) else steps)
    inside = {**rt.host_spans, ("launch_gaps" if rt.shape == "cuda" else "python_between_ops"): fb}
    out, left = {}, other
    for part in HOST_OTHER_PARTS[:-1]:
        got = left.intersect(inside[part]) if part in inside else _EMPTY
        out[part] = got.measure(lo, hi)
        left = left.minus(got) if len(got) else left
    out["unexplained"] = np.clip(other.measure(lo, hi) - sum(out.values()), 0, None)
    return out


def group_axes(rt: RankTrace, comm_groups: dict[str, Intervals] | None = None,
               group_ranks: dict[str, list[int]] | None = None) -> dict[str, str]:
    """Each process group of the trace -> the mesh axis it is (from ``rt.mesh_groups``, which
    MFUMonitor writes from the strategy's mesh): by group name, else by the same ranks (e.g. the world
    group when one axis spans every rank); ``"world"`` for the world group when no axis spans every rank
    (Lightning's own barriers, broadcasts and logged reductions), ``"unmapped"`` when nothing matches.
    ``comm_groups`` and ``group_ranks`` default to the trace's own (``rt.comm_groups``, ``rt.group_ranks``)."""
    axes = {a: g for a, g in (rt.mesh_groups or {}).items() if isinstance(g, dict)}
    # axes of one rank set share one process group (meshkit's mesh makes one per rank set): the largest
    # axis names it, ties (size-1 axes) the first in mesh order
    order = sorted(axes, key=lambda a: -len(axes[a].get("ranks") or []))
    by_name: dict[str, str] = {}
    by_ranks: dict[tuple[int, ...], str] = {}
    for a in order:
        g = axes[a]
        if g.get("group_name") is not None:
            by_name.setdefault(str(g["group_name"]), a)
        if isinstance(g.get("ranks"), list):
            by_ranks.setdefault(tuple(sorted(g["ranks"])), a)
    known = rt.group_ranks if group_ranks is None else group_ranks
    world = tuple(range(rt.world_size)) if rt.world_size else None
    out = {}
    for name in (rt.comm_groups if comm_groups is None else comm_groups):
        ranks = tuple(sorted(known.get(name, [])))
        out[name] = by_name.get(name) or by_ranks.get(ranks) or ("world" if ranks == world else "unmapped")
    return out


def thread_groups(ranks: dict[int, RankTrace], instances: list[dict[str, Any]]
                  ) -> dict[int, tuple[dict[str, Intervals], dict[str, list[int]]]]:
    """gloo traces record no process group per collective: a worker thread's group is read off the ranks
    its collectives were matched with across ranks (:func:`match_collectives`; a gloo group runs its
    collectives on threads of its own). A match may miss members (a rank that ended outside the matching
    tolerance), so a thread's group is the smallest mesh-axis group of this rank that holds every member
    it was matched with (its most frequent such group); a thread that ran a collective started inside
    ``meshkit:stop_signal`` (Lightning's per-batch broadcast on the world group) is the world group's; a
    thread never matched belongs to the one axis of size > 1 when that axis spans every rank (then every
    collective of the run is on it: tp-only, FSDP-only, DDP). Per rank with gloo spans, a mesh map and no
    recorded groups:
    ``({"ranks [0, 1]": the spans, ...}, {"ranks [0, 1]": [0, 1], ...})``; a thread matching no axis
    keeps its member set (``unmapped`` then)."""
    want = {r for r, rt in ranks.items() if rt.shape == "cpu" and rt.collectives and not rt.comm_groups
            and rt.mesh_groups}
    if not want:
        return {}
    where = {r: {(s, e): tid for _, s, e, tid in ranks[r].collectives} for r in want}
    votes: dict[tuple[int, Any], dict[tuple[int, ...], int]] = {}
    for x in instances:
        members = tuple(sorted(x["members"]))
        for r, span in x["members"].items():
            if r in want and span in where[r]:
                v = votes.setdefault((r, where[r][span]), {})
                v[members] = v.get(members, 0) + 1
    out: dict[int, tuple[dict[str, Intervals], dict[str, list[int]]]] = {}
    for r in want:
        rt = ranks[r]
        sets = sorted({tuple(sorted(g["ranks"])) for g in rt.mesh_groups.values()
                       if isinstance(g, dict) and isinstance(g.get("ranks"), list)}, key=len)
        big = [m for m in sets if len(m) > 1]
        world = tuple(range(rt.world_size or max(ranks) + 1))
        alone = big[0] if len(big) == 1 and big[0] == world else None
        group: dict[Any, tuple[int, ...] | None] = {}
        stop = rt.phases.get("stop_signal")
        starts = np.array([c[1] for c in rt.collectives])
        on_world = {c[3] for c, inside in zip(rt.collectives, stop._contains(starts))
                    if inside} if stop is not None and len(stop) else set()
        for tid in {c[3] for c in rt.collectives}:
            if tid in on_world:  # the world group's thread (its matches, a broadcast of 4 ranks, are few)
                group[tid] = world
                continue
            v = votes.get((r, tid), {})
            held: dict[tuple[int, ...], int] = {}
            for members, n in v.items():
                axis = next((m for m in sets if set(members) <= set(m)), members)
                held[axis] = held.get(axis, 0) + n
            group[tid] = max(held, key=lambda m: (held[m], m)) if held else alone
        spans: dict[str, tuple[list, list]] = {}
        named: dict[str, list[int]] = {}
        for _, s, e, tid in rt.collectives:
            if group[tid] is not None:
                key = f"ranks {list(group[tid])}"
                named[key] = list(group[tid])
                spans.setdefault(key, ([], []))[0].append(s), spans[key][1].append(e)
        out[r] = ({k: Intervals.union(a, b) for k, (a, b) in spans.items()}, named)
    return out


def exposed_comm_by_axis(rt: RankTrace, comm_groups: dict[str, Intervals] | None = None,
                         group_ranks: dict[str, list[int]] | None = None) -> dict[str, np.ndarray] | None:
    """Per-step µs of exposed communication (``comm − compute``, the entry's ``exposed_comm_ms``) by mesh
    axis (the axes of ``rt.mesh_groups``, in its order, then ``unmapped``); where collectives of several
    axes are exposed at once, the first axis in that order claims the moment. None without a mesh map.
    ``comm_groups`` / ``group_ranks``: the comm by group when the trace records none (:func:`thread_groups`)."""
    if not rt.mesh_groups:
        return None
    groups = rt.comm_groups if comm_groups is None else comm_groups
    lo, hi = rt.step_windows[:, 0], rt.step_windows[:, 1]
    exposed = rt.comm.minus(rt.compute)
    where = group_axes(rt, groups, group_ranks)
    order = [a for a in rt.mesh_groups] + ["world", "unmapped"]
    out, claimed = {}, _EMPTY
    for axis in order:
        mine = [groups[g] for g, a in where.items() if a == axis]
        part = Intervals.union_of(*mine).intersect(exposed).minus(claimed) if mine else _EMPTY
        out[axis] = part.measure(lo, hi)
        claimed = Intervals.union_of(claimed, part) if len(part) else claimed
    known = Intervals.union_of(*groups.values()) if groups else _EMPTY
    out["unmapped"] = out["unmapped"] + exposed.minus(known).measure(lo, hi)  # no group recorded
    for extra in ("world", "unmapped"):  # beside the axes only when they hold time
        if not out[extra].any():
            del out[extra]
    return out


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
        widest = _end_tolerance(max(x[3] - x[2] for x in items), 0.0)
        used: set[tuple[int, int]] = set()
        for r, i, s, e in items:
            if (r, i) in used:
                continue
            members = {r: (s, e)}
            used.add((r, i))
            lo, hi = np.searchsorted(ends, e - widest), np.searchsorted(ends, e + widest, side="right")
            best: dict[int, tuple[float, int, float, float]] = {}
            for r2, i2, s2, e2 in items[lo:hi]:
                if r2 == r or (r2, i2) in used or s2 > e:
                    continue
                d = abs(e2 - e)
                if d <= _end_tolerance(e - s, e2 - s2) and (r2 not in best or d < best[r2][0]):
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


def _end_tolerance(dur_a: float, dur_b: float) -> float:
    """How far apart (µs) two ranks' ends of one collective instance may be: ``max(1 ms, 5 %)`` of the
    longer of the two, so a late arrival's short span matches the long wait of the rank it kept
    waiting (whose wake-up a loaded host delays by more than the short span's own 5 %)."""
    return max(1000.0, 0.05 * max(dur_a, dur_b))


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
                     min_lateness_ms: float = 0.0, *, instances: list[dict[str, Any]] | None = None
                     ) -> dict[str, Any]:
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
    instances = match_collectives(ranks) if instances is None else instances
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


def _rank_entry(rt: RankTrace, claims: list[tuple[str, Intervals]],
                groups: tuple[dict[str, Intervals], dict[str, list[int]]] | None = None) -> dict[str, Any]:
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
    entry["compute_classes_ms"] = {k: _ms(v) for k, v in compute_split(rt, claims).items()}
    by_axis = exposed_comm_by_axis(rt, *(groups or (None, None)))
    if by_axis is None:
        entry["exposed_comm_by_axis_ms"] = None
        entry["exposed_comm_by_axis_missing"] = ("no mesh map in the trace (MFUMonitor writes "
                                                 "`meshkit_mesh_groups` from the strategy's mesh)")
    else:
        entry["exposed_comm_by_axis_ms"] = {k: _ms(v) for k, v in by_axis.items()}
    entry["host_other_split_ms"] = {k: _ms(v) for k, v in host_other_split(rt, claims).items()}
    if rt.flops is not None:
        n = entry["steps"]
        f = rt.flops
        entry["model_flops"] = {k: float(f.get(k, 0.0)) * n for k in ("matmul", "attention")}
        entry["recompute_ms"] = round(float(f.get("recompute_share", 0.0)) * entry["buckets_ms"]["compute"], 6)
        entry["flops_source"] = str(f.get("source", "?"))
    ms = lambda v: [round(x / _US_PER_MS, 6) for x in v.tolist()]  # noqa: E731 (tolist: the same floats)
    m_ms, b_ms = {f"{k}_ms": ms(v) for k, v in m.items()}, {k: ms(v) for k, v in b.items()}
    entry["per_step"] = [
        {"step": int(s), **{k: v[i] for k, v in m_ms.items()}, "buckets_ms": {k: v[i] for k, v in b_ms.items()}}
        for i, s in enumerate(rt.step_ids.tolist())
    ]
    if by_axis is not None:
        a_ms = {k: ms(v) for k, v in by_axis.items()}
        for i, st in enumerate(entry["per_step"]):
            st["exposed_comm_by_axis_ms"] = {k: v[i] for k, v in a_ms.items()}
    return entry


def run_peak(ranks: dict[int, RankTrace]) -> tuple[dict[str, Any] | None, list[str]]:
    """The run's one peak: the one MFUMonitor recorded on the lowest rank (it calibrates once and shares
    it); a rank that recorded another one is named in the problems (its waterfall uses the run's)."""
    recorded = {r: rt.peak for r, rt in sorted(ranks.items()) if isinstance(rt.peak, dict)
                and isinstance(rt.peak.get("flops"), (int, float)) and rt.peak["flops"] > 0}
    if not recorded:
        return None, []
    first = next(iter(recorded))
    source = recorded[first].get("source", "?")
    peak = {"flops": float(recorded[first]["flops"]), "source": f"as recorded by rank {first}: {source}"}
    other = {r: p["flops"] for r, p in recorded.items() if float(p["flops"]) != peak["flops"]}
    problems = [f"ranks recorded different peaks ({', '.join(f'rank {r}: {v:.4g}' for r, v in other.items())}, "
                f"rank {first}: {peak['flops']:.4g} FLOP/s); every waterfall uses rank {first}'s"] if other else []
    return peak, problems


def add_waterfall(entry: dict[str, Any], peak: dict[str, Any] | None) -> None:
    """Put the MFU waterfall (:func:`meshkit.profiling.report.waterfall`) into a rank's entry, from its
    totals: ``peak_flops``, ``mfu_pct``, ``waterfall``, ``host_other_split`` (points); ``waterfall`` is None
    (and ``waterfall_missing`` says why) without a peak or model FLOPs in the trace."""
    entry["peak_flops"] = peak["flops"] if peak else None
    wall_s = entry["wall_ms"] / 1e3
    why = ("no peak FLOP/s in the trace (MFUMonitor writes `meshkit_peak`)" if peak is None else
           "no model FLOPs in the trace (MFUMonitor writes `meshkit_flops`)" if "model_flops" not in entry else
           "no step time" if wall_s <= 0 else None)
    if why is not None:
        entry["waterfall"], entry["waterfall_missing"] = None, why
        return
    entry.pop("waterfall_missing", None)
    b, wall = entry["buckets_ms"], entry["wall_ms"]
    rec = min(entry.get("recompute_ms", 0.0), b["compute"])
    shares = {k: v / wall for k, v in b.items()}
    shares["compute"], shares["recompute"] = (b["compute"] - rec) / wall, rec / wall
    cls = entry["compute_classes_ms"]
    classes = {k: cls[k] / b["compute"] for k in ("attention", "matmul")} if b["compute"] > 0 else {}
    delivered = {k: v / (peak["flops"] * wall_s) for k, v in entry["model_flops"].items()}
    entry["waterfall"] = [{"part": p["part"], "points": round(p["points"], 6)}
                          for p in waterfall(shares, classes, delivered)]
    entry["mfu_pct"] = entry["waterfall"][-1]["points"]
    entry["host_other_split"] = {k: round(100.0 * v / wall, 6) for k, v in entry["host_other_split_ms"].items()}


def analyze_window(ranks: dict[int, RankTrace], *, min_lateness_ms: float = 0.0) -> dict[str, Any]:
    """One profiler window's analysis from already loaded :class:`RankTrace` s (see :func:`analyze`)."""
    claims = {r: step_claims(rt) for r, rt in ranks.items()}
    instances = match_collectives(ranks) if len(ranks) > 1 else []
    threads = thread_groups(ranks, instances)
    out = {str(r): _rank_entry(rt, claims[r], threads.get(r)) for r, rt in ranks.items()}
    peak, peak_problems = run_peak(ranks)
    for entry in out.values():
        add_waterfall(entry, peak)
    blocked = {r: dict(c)["exposed_comm"] for r, c in claims.items()}
    rep = straggler_report(ranks, blocked, min_lateness_ms, instances=instances)
    for r, per_root in rep["waiting_for_ms"].items():
        out[str(r)]["waiting_for_ms"] = {str(k): v for k, v in sorted(per_root.items())}
    problems = [f"rank {r}: {p}" for r, rt in ranks.items() for p in rt.problems] + rep["problems"] + peak_problems
    return {"ranks": out, "stragglers": rep["stragglers"], "straggler": rep["straggler"],
            "noise_floor_ms": rep["noise_floor_ms"], "problems": problems, "peak": peak}


def _sum_entries(entries: list[dict[str, Any]]) -> dict[str, Any]:
    total = dict(entries[0])
    for e in entries[1:]:
        for k, v in e.items():
            if k.endswith("_ms") and isinstance(v, float):
                total[k] = round(total.get(k, 0.0) + v, 6)
            elif k in ("buckets_ms", "waiting_for_ms", "compute_classes_ms", "host_other_split_ms", "model_flops",
                       "exposed_comm_by_axis_ms") and isinstance(v, dict) and isinstance(total.get(k, {}), dict):
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
    peak, peak_problems = run_peak({r: rt for w in windows for r, rt in sorted(w.ranks.items())})
    problems.extend(p for p in peak_problems if not any(p in q for q in problems))
    for r in sorted({int(r) for pw in per_window for r in pw["ranks"]}):
        mine = [pw["ranks"][str(r)] for pw in per_window if str(r) in pw["ranks"]]
        ranks[str(r)] = _sum_entries(mine)
        if not all("model_flops" in e for e in mine):  # FLOPs of only some windows: no MFU over all of them
            ranks[str(r)].pop("model_flops", None)
        add_waterfall(ranks[str(r)], peak)
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
        "peak_flops": peak["flops"] if peak else None, "peak_source": peak["source"] if peak else None,
        "bad_events": [{"window": w.key, "rank": r, **b, "message": f"rank {r}, window {w.key}: {b['message']}"}
                       for w in windows for r, rt in sorted(w.ranks.items()) for b in rt.bad_events],
        "trace_bytes": int(sum(rt.bytes for w in windows for rt in w.ranks.values())),
        "events": int(sum(rt.events for w in windows for rt in w.ranks.values())),
    }


def format_analysis(result: dict[str, Any]) -> str:
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
    falls = {r: v["waterfall"] for r, v in result["ranks"].items() if v.get("waterfall")}
    if falls:
        names = [p["part"] for p in next(iter(falls.values()))[1:]]
        lines += ["", "MFU waterfall, MFU points from the peak (100) to the achieved MFU (docs/profiling.md: each "
                  "part and what to do):", "rank " + " ".join(f"{n:>{max(len(n), 8)}}" for n in names)]
        for r, w in falls.items():
            lines.append(f"{r:>4} " + " ".join(f"{p['points']:>{max(len(p['part']), 8)}.3f}" for p in w[1:]))
    by_axis = {r: v["exposed_comm_by_axis_ms"] for r, v in result["ranks"].items() if v.get("exposed_comm_by_axis_ms")}
    if by_axis:
        axes = list(dict.fromkeys(a for v in by_axis.values() for a in v))
        lines += ["", "exposed communication by mesh axis, ms summed over the same steps:",
                  "rank " + " ".join(f"{a:>13}" for a in axes)]
        for r, v in by_axis.items():
            lines.append(f"{r:>4} " + " ".join(f"{v.get(a, 0.0):>13.3f}" for a in axes))
    lines.append("")
    lines.append(f"windows used (first batch): {result.get('windows_used', [])}")
    if result.get("peak_flops"):
        lines.append(f"peak FLOP/s of this run (every rank's MFU and waterfall): {result['peak_flops']:.4g} "
                     f"({result.get('peak_source') or '?'})")
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
        print(format_analysis(result))
    if result["partial"]:
        n_bad = sum(b["count"] for b in result["bad_events"])
        print(f"meshkit analyze: warning: partial result ({len(result['problems'])} problems"
              + (f"; {n_bad} bad trace events skipped" if n_bad else "") + ")", file=sys.stderr)
    return 0
