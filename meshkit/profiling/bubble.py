"""Pipeline bubble: theory, a schedule simulator, the measured bubble of a real run, a Gantt chart.

Throughout, ``bubble_fraction = idle time ÷ total time`` (summed over stages), where a stage's
idle time is the step's span minus the time it spent executing pipeline actions.

Action letters: ``F`` forward, ``B`` full backward, ``I`` input-gradient backward and ``W``
weight-gradient backward (zero-bubble schedules split ``B`` into ``I`` + ``W``).

Schedule names, the closed-form theory and the timeline record are the ground floor's:
:mod:`meshkit.schedules` (torch's names; "interleaved" and "zero-bubble" are aliases) and
:mod:`meshkit.timeline` (``pp_timeline_rank{R}.jsonl``, written by the pipeline plugin and read
here without importing it; ``read_timeline`` and ``TimelineRecord`` are re-exported).

Example::

    >>> theoretical_bubble("1f1b", 4, 8)   # meshkit.schedules' theory: (p-1)/(m+p-1)
    0.2727272727272727
    >>> round(simulate("1f1b", stages=4, microbatches=8).bubble_fraction, 6)
    0.272727
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

from meshkit.schedules import SCHEDULE_FACTS, SCHEDULE_NAMES, canonical_schedule, step_time, theoretical_bubble
from meshkit.timeline import TimelineRecord, find_timeline_dir, read_timeline

__all__ = [
    "SIMULATED_SCHEDULES",
    "theoretical_bubble",
    "Action",
    "schedule_orders",
    "SimResult",
    "simulate",
    "TimelineRecord",
    "read_timeline",
    "find_timeline_dir",
    "MeasuredBubble",
    "measured_bubble",
    "hop_latency_ns",
    "simulate_from_timeline",
    "gantt_figure",
    "format_time",
    "format_fraction",
    "format_bubble",
    "configure_parser",
    "run_cli",
]

SIMULATED_SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b", "interleaved_1f1b", "interleaved_zero_bubble")
"""Schedules :func:`schedule_orders` builds (interleaved_zero_bubble with one stage per rank: ZB-H1);
the theory (:func:`meshkit.schedules.theoretical_bubble`, re-exported here) takes every name of
:data:`meshkit.schedules.SCHEDULE_NAMES`."""


def _schedule_name(schedule: str) -> str:
    try:
        return canonical_schedule(schedule)
    except ValueError:
        raise ValueError(f"bubble: `schedule={schedule!r}` is unknown; choose one of {SCHEDULE_NAMES} "
                         "(aliases: interleaved, zero-bubble).") from None


def _check_sizes(p: int, m: int, v: int, schedule: str) -> None:
    for name, value in (("stages", p), ("microbatches", m), ("virtual", v)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"bubble: `{name}={value!r}` must be an int >= 1.")
    if not SCHEDULE_FACTS[schedule].multi_stage and v != 1:
        raise ValueError(f"bubble: `virtual={v}` needs a multi-stage schedule such as 'interleaved_1f1b' "
                         f"(got {schedule!r}); use -v 1.")
    if schedule == "interleaved_1f1b" and m % p:  # the simulator's order; torch itself runs any m (meshkit.schedules)
        raise ValueError(
            f"bubble: the interleaved schedule needs `microbatches={m}` to be a multiple of `stages={p}` "
            "(Megatron's rule); choose m = k·p."
        )


def _check_times(tf: float, tb: float, tw: float | None, schedule: str) -> None:
    for name, value in (("tf", tf), ("tb", tb)):
        if not value > 0:
            raise ValueError(f"bubble: `{name}={value!r}` must be > 0 (time of one microbatch's {name[1:].upper()}).")
    if SCHEDULE_FACTS[schedule].split_backward and (tw is None or not tw > 0):
        raise ValueError(f"bubble: `tw={tw!r}`: the zero-bubble schedules need the weight-grad time --tw > 0 "
                         "(and --tb is then the input-grad time).")


# ---------------------------------------------------------------------------------- theory


def _theory(schedule: str, stages: int, microbatches: int, virtual: int, tf: float, tb: float,
            tw: float | None) -> tuple[float, float]:
    """``meshkit bubble``'s theory row, ``(total_time, bubble_fraction)``: the one theory
    (:func:`meshkit.schedules.step_time`, :func:`~meshkit.schedules.theoretical_bubble`) in its own
    convention, where ``--tb`` is the full backward unless the schedule splits it (then ``--tw`` is W)."""
    s = _schedule_name(schedule)
    _check_sizes(stages, microbatches, virtual, s)
    _check_times(tf, tb, tw, s)
    w = tw if SCHEDULE_FACTS[s].split_backward else 0.0
    total, _ = step_time(s, stages, microbatches, virtual, tf=tf, tb=tb, tw=w)
    return total, theoretical_bubble(s, stages, microbatches, virtual, tf=tf, tb=tb, tw=w)


# ------------------------------------------------------------------------------- simulator


@dataclass(frozen=True)
class Action:
    """One pipeline action: ``kind`` F/B/I/W of ``microbatch`` on virtual stage ``stage``."""

    kind: str
    microbatch: int
    stage: int


def _interleaved_index(k: int, p: int, v: int, forward: bool) -> tuple[int, int]:
    # Megatron: microbatches advance in groups of p through the v chunks.
    chunk = (k // p) % v
    if not forward:
        chunk = v - 1 - chunk
    mb = (k // (p * v)) * p + k % p
    return chunk, mb


def _has_order(schedule: str, virtual: int) -> bool:
    return schedule in SIMULATED_SCHEDULES and not (schedule == "interleaved_zero_bubble" and virtual != 1)


def schedule_orders(schedule: str, stages: int, microbatches: int, virtual: int = 1) -> list[list[Action]]:
    """The per-rank action order of a schedule (``stage`` is the virtual stage, ``chunk·p + rank``).

    >>> [f"{a.kind}{a.microbatch}" for a in schedule_orders("1f1b", 2, 3)[0]]
    ['F0', 'F1', 'B0', 'F2', 'B1', 'B2']
    """
    s = _schedule_name(schedule)
    p, m, v = stages, microbatches, virtual
    _check_sizes(p, m, v, s)
    if not _has_order(s, v):
        raise ValueError(f"bubble: no built-in order for `schedule={s!r}` with `virtual={v}` (built in: {SIMULATED_SCHEDULES}, "
                         "interleaved_zero_bubble as ZB-H1 with -v 1); pass explicit per-rank orders to simulate.")
    orders: list[list[Action]] = []
    for r in range(p):
        if s == "gpipe":
            order = [Action("F", i, r) for i in range(m)] + [Action("B", i, r) for i in range(m)]
        elif s in ("1f1b", "interleaved_zero_bubble"):
            bk = "I" if s == "interleaved_zero_bubble" else "B"
            warm = min(p - 1 - r, m)
            order = [Action("F", i, r) for i in range(warm)]
            f, b = warm, 0
            while f < m:
                order += [Action("F", f, r), Action(bk, b, r)]
                f, b = f + 1, b + 1
            order += [Action(bk, i, r) for i in range(b, m)]
        else:  # interleaved
            total = m * v
            warm = min((p - r - 1) * 2 + (v - 1) * p, total)
            fw = [_interleaved_index(k, p, v, True) for k in range(total)]
            bw = [_interleaved_index(k, p, v, False) for k in range(total)]
            order = [Action("F", mb, c * p + r) for c, mb in fw[:warm]]
            f, b = warm, 0
            while f < total:
                (cf, mf), (cb, mbb) = fw[f], bw[b]
                order += [Action("F", mf, cf * p + r), Action("B", mbb, cb * p + r)]
                f, b = f + 1, b + 1
            order += [Action("B", mb, c * p + r) for c, mb in bw[b:]]
        orders.append(order)
    return orders


@dataclass
class SimResult:
    """A simulated (or replayed) step: per-rank intervals and the numbers the CLI prints."""

    total_time: float
    ideal_time: float
    bubble_fraction: float
    peak_inflight_microbatches: list[int]
    timeline: list[list[tuple[Action, float, float]]] = field(repr=False, default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"total_time": self.total_time, "ideal_time": self.ideal_time,
                "bubble_fraction": self.bubble_fraction,
                "peak_inflight_microbatches": list(self.peak_inflight_microbatches)}


def _deps(a: Action, n_virtual: int, split: bool) -> list[tuple[str, int, int]]:
    if a.kind == "F":
        return [("F", a.microbatch, a.stage - 1)] if a.stage > 0 else []
    if a.kind in ("B", "I"):
        own = [("F", a.microbatch, a.stage)]
        if a.stage < n_virtual - 1:
            own.append(("I" if split else "B", a.microbatch, a.stage + 1))
        return own
    return [("I", a.microbatch, a.stage)]  # W after its I


def simulate(schedule: str | Sequence[Sequence[Action]], stages: int | None = None, microbatches: int | None = None,
             virtual: int = 1, tf: float | Sequence[float] = 1.0, tb: float | Sequence[float] = 2.0,
             tw: float | Sequence[float] | None = None,
             durations: Mapping[tuple[str, int], float] | None = None, comm: float = 0.0) -> SimResult:
    """Run a pipeline schedule on an idealised machine (no communication time) and time it.

    ``schedule`` is a name (with ``stages``, ``microbatches``, ``virtual``) or explicit per-rank
    action orders (:func:`schedule_orders` shape). Times per action are ``tf``/``tb``/``tw``
    (one value, or one per virtual stage) divided by ``virtual`` for named interleaved
    schedules, or ``durations[(kind, stage)]`` (e.g. measured means) when given. ``comm`` is the
    time from an action's end until a stage on another rank can use its output (one P2P hop;
    0 models free communication). For
    ``zero-bubble`` the ``W`` actions are deferred (rank r keeps at most r pending) and run
    whenever the stage would otherwise wait, and at the end: ZB-H1. Raises ``ValueError`` on a deadlocking order.

    >>> simulate("gpipe", stages=2, microbatches=2, tf=1, tb=1).total_time
    6.0
    """
    if isinstance(schedule, str):
        name = _schedule_name(schedule)
        if stages is None or microbatches is None:
            raise ValueError("simulate: a named schedule needs `stages` and `microbatches`.")
        orders = schedule_orders(name, stages, microbatches, virtual)
        split = name == "interleaved_zero_bubble"
        if split and tw is None:
            raise ValueError("simulate: `tw=None`: the zero-bubble schedule needs a weight-grad time.")
        scale = 1.0 / virtual
    else:
        orders = [list(o) for o in schedule]
        name, split, scale = "custom", any(a.kind in ("I", "W") for o in orders for a in o), 1.0
    n_virtual = max(a.stage for o in orders for a in o) + 1
    if comm < 0:
        raise ValueError(f"simulate: `comm={comm}` must be >= 0.")
    owner = {a.stage: r for r, o in enumerate(orders) for a in o}

    def per(x: Any, stage: int) -> float:
        return float(x[stage] if isinstance(x, (list, tuple)) else x)

    def dur(a: Action) -> float:
        if durations is not None and (a.kind, a.stage) in durations:
            return float(durations[(a.kind, a.stage)])
        base = {"F": tf, "B": tb, "I": tb, "W": tw}[a.kind]
        if base is None:
            raise ValueError(f"simulate: no time for action {a.kind} of stage {a.stage}; pass `tw` or `durations`.")
        return per(base, a.stage) * scale

    if split and name == "interleaved_zero_bubble":
        # Deferred W: take them out of the order; they fill waits and the tail.
        orders_main = [[a for a in o if a.kind != "W"] for o in orders]
        pending_w: list[list[Action]] = [[] for _ in orders]
    else:
        orders_main, pending_w = orders, [[] for _ in orders]
    done: dict[tuple[str, int, int], float] = {}
    free = [0.0] * len(orders)
    pos = [0] * len(orders)
    timeline: list[list[tuple[Action, float, float]]] = [[] for _ in orders]
    deferred = split and name == "interleaved_zero_bubble"
    # ZB-H1: rank r keeps at most r weight-grads pending, so every stage holds at most p
    # microbatches' activations (1F1B's first-stage peak) and the bubble is (p-1)(F+B-W).
    w_cap = list(range(len(orders)))
    remaining = sum(len(o) for o in orders_main)
    while remaining:
        progressed = False
        for r, order in enumerate(orders_main):
            while pos[r] < len(order):
                a = order[pos[r]]
                deps = _deps(a, n_virtual, split)
                if any(d not in done for d in deps):
                    break
                ready = max([done[d] + (comm if owner[d[2]] != r else 0.0) for d in deps], default=0.0)
                while deferred and pending_w[r] and free[r] < ready:  # fill the wait with a W
                    w = pending_w[r].pop(0)
                    timeline[r].append((w, free[r], free[r] + dur(w)))
                    free[r] += dur(w)
                    done[(w.kind, w.microbatch, w.stage)] = free[r]
                start = max(free[r], ready)
                end = start + dur(a)
                timeline[r].append((a, start, end))
                done[(a.kind, a.microbatch, a.stage)] = end
                free[r] = end
                pos[r] += 1
                remaining -= 1
                progressed = True
                if deferred and a.kind == "I":
                    pending_w[r].append(Action("W", a.microbatch, a.stage))
                    while len(pending_w[r]) > w_cap[r]:  # ZB-H1 memory cap: like 1F1B's in-flight count
                        w = pending_w[r].pop(0)
                        timeline[r].append((w, free[r], free[r] + dur(w)))
                        free[r] += dur(w)
                        done[(w.kind, w.microbatch, w.stage)] = free[r]
        if not progressed:
            stuck = {r: order[pos[r]] for r, order in enumerate(orders_main) if pos[r] < len(order)}
            raise ValueError(f"simulate: the schedule deadlocks; each rank waits on a dependency: {stuck}.")
    for r in range(len(orders)):
        for w in pending_w[r]:
            timeline[r].append((w, free[r], free[r] + dur(w)))
            free[r] += dur(w)
    return _summarize(timeline, split)


def _summarize(timeline: list[list[tuple[Action, float, float]]], split: bool) -> SimResult:
    t0 = min(s for tl in timeline for _, s, _ in tl)
    t1 = max(e for tl in timeline for _, _, e in tl)
    total = t1 - t0
    busy = [sum(e - s for _, s, e in tl) for tl in timeline]
    idle = sum(total - b for b in busy)
    release = "W" if split else "B"
    peaks = []
    for tl in timeline:
        events = []
        for a, s, e in tl:
            if a.kind == "F":
                events.append((s, 1))
            elif a.kind == release:
                events.append((e, -1))
        events.sort(key=lambda x: (x[0], x[1]))  # release before admit at equal times
        cur = peak = 0
        for _, d in events:
            cur += d
            peak = max(peak, cur)
        peaks.append(peak)
    return SimResult(float(total), float(max(busy)), float(idle / (total * len(timeline))) if total else 0.0,
                     peaks, timeline)


# --------------------------------------------------------------------------- measured


@dataclass
class MeasuredBubble:
    """Bubble of a recorded run: idle ÷ (span × ranks), per step and overall."""

    bubble_fraction: float
    """Mean over the steps analysed."""
    per_step: dict[int, float]
    per_rank: dict[int, Any]
    """rank -> object with ``idle_ns`` and ``bubble_fraction`` summed over the steps analysed."""
    step_time_ns: float
    """Mean step span (first action start to last action end, all ranks)."""


@dataclass
class _RankIdle:
    idle_ns: float = 0.0
    span_ns: float = 0.0

    @property
    def bubble_fraction(self) -> float:
        return self.idle_ns / self.span_ns if self.span_ns else 0.0


def _group(records: Iterable[TimelineRecord]) -> dict[int, dict[int, list[TimelineRecord]]]:
    steps: dict[int, dict[int, list[TimelineRecord]]] = defaultdict(lambda: defaultdict(list))
    for rec in records:
        steps[rec.step][rec.rank].append(rec)
    return steps


def measured_bubble(records: Sequence[TimelineRecord], skip_steps: int = 0) -> MeasuredBubble:
    """The bubble a run really had: per step, each rank's idle time inside the step's span
    (first action start to last action end over all ranks), over span × ranks.

    ``skip_steps`` drops the first steps (warm-up). Overlapping actions on one rank are merged.
    """
    from meshkit.profiling.trace import Intervals

    steps = _group(records)
    if not steps:
        raise ValueError("measured_bubble: `records` is empty; the run recorded no pipeline actions.")
    chosen = sorted(steps)[skip_steps:]
    if not chosen:
        raise ValueError(f"measured_bubble: `skip_steps={skip_steps}` leaves none of the {len(steps)} steps.")
    per_step, per_rank = {}, defaultdict(_RankIdle)
    spans = []
    for st in chosen:
        by_rank = steps[st]
        t0 = min(r.start_ns for recs in by_rank.values() for r in recs)
        t1 = max(r.end_ns for recs in by_rank.values() for r in recs)
        span = float(t1 - t0)
        spans.append(span)
        idle_total = 0.0
        for rank, recs in by_rank.items():
            busy = Intervals.union([r.start_ns for r in recs], [r.end_ns for r in recs]).total
            per_rank[rank].idle_ns += span - busy
            per_rank[rank].span_ns += span
            idle_total += span - busy
        per_step[st] = idle_total / (span * len(by_rank)) if span else 0.0
    return MeasuredBubble(sum(per_step.values()) / len(per_step), per_step, dict(per_rank), sum(spans) / len(spans))


def hop_latency_ns(records: Sequence[TimelineRecord], skip_steps: int = 0) -> float:
    """Median time from an action's end to the start of the action on the next rank that was
    waiting for it (its previous action had ended before): the measured cost of one P2P hop,
    including the host work between actions. 0.0 when no action ever waited on another rank.
    """
    steps = _group(records)
    gaps = []
    for st in sorted(steps)[skip_steps:]:
        by_key = {(r.action, r.microbatch, r.stage): r for recs in steps[st].values() for r in recs}
        prev_end = {}
        for recs in steps[st].values():
            ordered = sorted(recs, key=lambda x: x.start_ns)
            for before, rec in zip(ordered, ordered[1:]):
                prev_end[(rec.action, rec.microbatch, rec.stage)] = before.end_ns
        n_virtual = max(r.stage for r in by_key.values()) + 1
        split = any(r.action in ("I", "W") for r in by_key.values())
        for key, rec in by_key.items():
            for dep in _deps(Action(*key), n_virtual, split):
                src = by_key.get(dep)
                if src is None or src.rank == rec.rank or prev_end.get(key, 0) > src.end_ns:
                    continue
                gaps.append(rec.start_ns - src.end_ns)
    return float(statistics.median(gaps)) if gaps else 0.0


def simulate_from_timeline(records: Sequence[TimelineRecord], step: int | None = None,
                           skip_steps: int = 0, comm: float | str = 0.0) -> SimResult:
    """Replay one recorded step's per-rank action order in the simulator with the measured mean
    duration of each (action, stage) over the steps analysed: what the schedule would take with
    these compute times. ``comm`` is the P2P hop time in ns (default 0: free communication), or
    ``"measured"`` for :func:`hop_latency_ns` of the record. Compare with :func:`measured_bubble`.
    """
    steps = _group(records)
    chosen = sorted(steps)[skip_steps:]
    if not chosen:
        raise ValueError("simulate_from_timeline: no steps left to replay.")
    step = chosen[-1] if step is None else step
    if step not in steps:
        raise ValueError(f"simulate_from_timeline: `step={step}` is not in the record (steps {sorted(steps)}).")
    if comm == "measured":
        comm = hop_latency_ns(records, skip_steps)
    elif isinstance(comm, str):
        raise ValueError(f"simulate_from_timeline: `comm={comm!r}` must be a time in ns or 'measured'.")
    sums: dict[tuple[str, int], list[float]] = defaultdict(list)
    for st in chosen:
        for recs in steps[st].values():
            for r in recs:
                sums[(r.action, r.stage)].append(r.duration_ns)
    durations = {k: sum(v) / len(v) for k, v in sums.items()}
    ranks = sorted(steps[step])
    orders = [[Action(r.action, r.microbatch, r.stage) for r in sorted(steps[step][rank], key=lambda x: x.start_ns)]
              for rank in ranks]
    return simulate(orders, durations=durations, comm=float(comm))


# ------------------------------------------------------------------------------------- figure

_COLORS = {"F": "#4c72b0", "B": "#dd8452", "I": "#c44e52", "W": "#55a868"}


def gantt_figure(source: SimResult | Sequence[TimelineRecord], step: int | None = None, title: str | None = None):
    """A per-rank timeline (Gantt chart) of a simulated step or one recorded step (matplotlib Figure)."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure

    rows: list[list[tuple[str, int, float, float]]] = []
    unit = "time"
    if isinstance(source, SimResult):
        rows = [[(a.kind, a.microbatch, s, e) for a, s, e in tl] for tl in source.timeline]
    else:
        steps = _group(source)
        if not steps:
            raise ValueError("gantt_figure: no records to draw.")
        step = max(steps) if step is None else step
        t0 = min(r.start_ns for recs in steps[step].values() for r in recs)
        rows = [[(r.action, r.microbatch, (r.start_ns - t0) / 1e6, (r.end_ns - t0) / 1e6) for r in steps[step][k]]
                for k in sorted(steps[step])]
        unit = "ms"
    fig = Figure(figsize=(10, 0.6 * len(rows) + 1.2))
    ax = fig.add_subplot(1, 1, 1)
    for y, row in enumerate(rows):
        for kind, mb, s, e in row:
            ax.barh(y, e - s, left=s, color=_COLORS.get(kind, "grey"), edgecolor="black", linewidth=0.3)
            if e - s > 0:
                ax.text((s + e) / 2, y, f"{kind}{mb}", ha="center", va="center", fontsize=6, color="white")
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"rank {i}" for i in range(len(rows))])
    ax.invert_yaxis()
    ax.set_xlabel(unit)
    ax.set_title(title or "pipeline timeline")
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------------------------- CLI

_SECONDS = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}

# key of the CLI's result -> (label, kind): "frac" prints as percent, "time" with its unit
_TEXT_ROWS: dict[str, tuple[str, str]] = {
    "schedule": ("schedule", "str"),
    "stages": ("stages (p)", "str"),
    "microbatches": ("microbatches (m)", "str"),
    "virtual": ("chunks per rank (v)", "str"),
    "total_time": ("step time, simulated", "time"),
    "ideal_time": ("busiest rank's compute", "time"),
    "bubble_fraction": ("bubble, simulated", "frac"),
    "peak_inflight_microbatches": ("peak in-flight microbatches per rank", "list"),
    "theoretical_bubble_fraction": ("bubble, closed form", "frac"),
    "theoretical_total_time": ("step time, closed form", "time"),
    "measured_bubble_fraction": ("bubble, measured", "frac"),
    "measured_step_time_ms": ("step time, measured (mean)", "time_ms"),
    "simulated_bubble_fraction": ("bubble, replayed (free hops)", "frac"),
    "hop_latency_ms": ("P2P hop, measured (median)", "time_ms"),
    "simulated_with_hops_bubble_fraction": ("bubble, replayed with measured hops", "frac"),
    "per_step_bubble_fraction": ("bubble per step, measured", "frac_map"),
    "time_unit": ("", "skip"),
    "gantt": ("Gantt chart", "str"),
}


def format_time(value: float, unit: str = "ms") -> str:
    """A time with its unit, 4 significant digits; known units (ns, us, ms, s) rescale to fit.

    >>> format_time(33.0), format_time(0.0123, "ms"), format_time(1500, "ms"), format_time(2.5, "ticks")
    ('33 ms', '12.3 us', '1.5 s', '2.5 ticks')
    """
    if unit not in _SECONDS or value == 0:
        return f"{value:.4g} {unit}"
    seconds = value * _SECONDS[unit]
    for name in ("s", "ms", "us", "ns"):
        if abs(seconds) >= _SECONDS[name] or name == "ns":
            return f"{seconds / _SECONDS[name]:.4g} {name}"
    raise AssertionError("unreachable")  # pragma: no cover


def format_fraction(value: float) -> str:
    """A fraction as a percent with 2 decimals: ``format_fraction(9 / 33) == '27.27 %'``."""
    return f"{100 * value:.2f} %"


def format_bubble(out: Mapping[str, Any], unit: str = "ms") -> str:
    """The text table of ``meshkit bubble``: fractions in percent, times with ``unit`` (``--json`` prints raw).

    >>> print(format_bubble({"schedule": "1f1b", "bubble_fraction": 9 / 33, "total_time": 33.0}, unit="ms"))
                schedule: 1f1b
       bubble, simulated: 27.27 %
    step time, simulated: 33 ms
    """
    rows: list[tuple[str, str]] = []
    for key, value in out.items():
        label, kind = _TEXT_ROWS.get(key, (key, "str"))
        if kind == "skip":
            continue
        if kind == "frac":
            text = format_fraction(value)
        elif kind == "time":
            text = format_time(value, unit)
        elif kind == "time_ms":
            text = format_time(value, "ms")
        elif kind == "list":
            text = ", ".join(str(v) for v in value)
        elif kind == "frac_map":
            text = ", ".join(f"step {k}: {format_fraction(v)}" for k, v in value.items())
        else:
            text = str(value)
        rows.append((label, text))
    width = max((len(label) for label, _ in rows), default=0)
    return "\n".join(f"{label:>{width}}: {text}" for label, text in rows)



def configure_parser(parser: argparse.ArgumentParser) -> None:
    """``meshkit bubble --schedule 1f1b -p 4 -m 8 [--tf 1 --tb 2 --tw ...] [--timeline DIR] [--json]``."""
    parser.add_argument("--schedule", default="1f1b", help=f"one of {', '.join(SCHEDULE_NAMES)} or an alias (interleaved, zero-bubble); "
                        f"simulated: {', '.join(SIMULATED_SCHEDULES)} (default 1f1b)")
    parser.add_argument("-p", "--stages", type=int, default=4, help="pipeline stages (ranks)")
    parser.add_argument("-m", "--microbatches", type=int, default=8, help="microbatches per step")
    parser.add_argument("-v", "--virtual", type=int, default=1, help="model chunks per rank (interleaved)")
    parser.add_argument("--tf", type=float, default=1.0, help="forward time of one microbatch on one stage (in --unit)")
    parser.add_argument("--tb", type=float, default=2.0,
                        help="backward time (full B; for zero-bubble the input-grad I) (in --unit)")
    parser.add_argument("--tw", type=float, default=None, help="weight-grad time W (zero-bubble) (in --unit)")
    parser.add_argument("--unit", default="ms",
                        help="the time unit of --tf/--tb/--tw, printed with every time (default ms; ns, us, s "
                             "rescale; any other name is printed as given); --timeline times are always ms")
    parser.add_argument("--timeline", default=None,
                        help="a run's pp_timeline directory (or log_dir): report its measured bubble too")
    parser.add_argument("--skip-steps", type=int, default=1, help="warm-up steps of --timeline to ignore")
    parser.add_argument("--gantt", default=None, help="write a Gantt chart PNG here")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")


def run_cli(args: argparse.Namespace) -> int:
    # a ValueError propagates: meshkit.cli prints `meshkit bubble: error: ...` on stderr, exit 2
    out: dict[str, Any]
    if args.timeline:
        tdir = find_timeline_dir(args.timeline) or args.timeline
        records = read_timeline(tdir)
        skip = min(args.skip_steps, max(len({r.step for r in records}) - 1, 0))
        meas = measured_bubble(records, skip_steps=skip)
        sim = simulate_from_timeline(records, skip_steps=skip)
        hop = hop_latency_ns(records, skip)
        sim_comm = simulate_from_timeline(records, skip_steps=skip, comm=hop)
        out = {**sim.to_dict(), "measured_bubble_fraction": meas.bubble_fraction,
               "measured_step_time_ms": meas.step_time_ns / 1e6,
               "simulated_bubble_fraction": sim.bubble_fraction,
               "hop_latency_ms": hop / 1e6,
               "simulated_with_hops_bubble_fraction": sim_comm.bubble_fraction,
               "per_step_bubble_fraction": {str(k): v for k, v in meas.per_step.items()}}
        out["total_time"] /= 1e6
        out["ideal_time"] /= 1e6
        out["time_unit"] = "ms"
        fig_src: Any = records
    else:
        name = _schedule_name(args.schedule)
        total, fraction = _theory(name, args.stages, args.microbatches, args.virtual, args.tf, args.tb, args.tw)
        out = {"schedule": name, "stages": args.stages, "microbatches": args.microbatches,
               "virtual": args.virtual}
        fig_src = None
        if _has_order(name, args.virtual):
            fig_src = simulate(name, args.stages, args.microbatches, args.virtual, args.tf, args.tb, args.tw)
            out.update(fig_src.to_dict())
        out.update({"theoretical_bubble_fraction": fraction, "theoretical_total_time": total})
        if args.gantt and fig_src is None:
            raise ValueError(f"--gantt needs a built-in order; `schedule={name!r}` has theory only.")
    if args.gantt:
        gantt_figure(fig_src).savefig(args.gantt, dpi=120)
        out["gantt"] = args.gantt
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        print(format_bubble(out, unit=out.get("time_unit", args.unit)))
    return 0
