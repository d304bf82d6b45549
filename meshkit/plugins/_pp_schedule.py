"""Pipeline schedule table, stage placement and micro-batch rules (pure functions, no process group).

Private to :mod:`meshkit.plugins.pipeline`, which re-exports the public names.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

from torch.distributed.pipelining import (
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
)


@dataclass(frozen=True)
class ScheduleSpec:
    """What meshkit needs to know about one torch schedule."""

    cls: type
    """The torch.distributed.pipelining schedule class."""
    multi_stage: bool
    """True: several stages per rank (takes ``virtual_stages``); False: exactly one."""
    placement: str
    """"loop" (stage s on pp rank s % pp) or "v" (rank r holds stages r and 2·pp-1-r)."""
    min_microbatches: str
    """The smallest micro-batch count torch accepts: "1", "stages" (one per stage)."""


SCHEDULES: dict[str, ScheduleSpec] = {
    "gpipe": ScheduleSpec(ScheduleGPipe, False, "loop", "1"),
    "1f1b": ScheduleSpec(Schedule1F1B, False, "loop", "stages"),
    "interleaved_1f1b": ScheduleSpec(ScheduleInterleaved1F1B, True, "loop", "1"),
    "looped_bfs": ScheduleSpec(ScheduleLoopedBFS, True, "loop", "1"),
    "interleaved_zero_bubble": ScheduleSpec(ScheduleInterleavedZeroBubble, True, "loop", "1"),
    "zbv_zero_bubble": ScheduleSpec(ScheduleZBVZeroBubble, True, "v", "stages"),
    "dualpipev": ScheduleSpec(ScheduleDualPipeV, True, "v", "stages"),
}


def schedule_spec(schedule: str) -> ScheduleSpec:
    """The :class:`ScheduleSpec` of ``schedule`` (case-insensitive); unknown names raise."""
    key = str(schedule).lower()
    if key not in SCHEDULES:
        raise ValueError(f"pipeline: `pp_schedule={schedule!r}` is not a known schedule. Use one of {sorted(SCHEDULES)}.")
    return SCHEDULES[key]


def resolve_virtual_stages(schedule: str, virtual_stages: int | None) -> int:
    """Stages per rank: 1 for single-stage schedules, ``virtual_stages`` (default 2) for multi-stage ones."""
    spec = schedule_spec(schedule)
    if virtual_stages is not None and (not isinstance(virtual_stages, int) or virtual_stages < 1):
        raise ValueError(f"pipeline: `pp_virtual_stages={virtual_stages!r}` must be a positive int.")
    if not spec.multi_stage:
        if virtual_stages not in (None, 1):
            multi = sorted(k for k, s in SCHEDULES.items() if s.multi_stage)
            raise ValueError(
                f"pipeline: `pp_virtual_stages={virtual_stages}` needs a multi-stage schedule, but "
                f"`pp_schedule={schedule!r}` runs exactly one stage per rank. Drop pp_virtual_stages or use one of {multi}."
            )
        return 1
    v = 2 if virtual_stages is None else virtual_stages
    if spec.placement == "v" and v != 2:
        raise ValueError(
            f"pipeline: `pp_schedule={schedule!r}` places stages in a V and needs exactly 2 stages per rank; "
            f"got `pp_virtual_stages={v}`. Use pp_virtual_stages=2."
        )
    return v


def stage_ids_on_rank(pp_rank: int, pp: int, virtual_stages: int, placement: str = "loop") -> tuple[int, ...]:
    """The stage indices pipeline rank ``pp_rank`` holds, in increasing order.

    "loop": ``pp_rank + s·pp`` for s < v. "v" (v = 2): ``pp_rank`` and ``2·pp - 1 - pp_rank``, so the
    first and the last stage share rank 0 (ZBV and DualPipeV).

    >>> stage_ids_on_rank(1, 4, 2), stage_ids_on_rank(1, 4, 2, "v")
    ((1, 5), (1, 6))
    """
    if placement == "v":
        if virtual_stages != 2:
            raise ValueError(f"pipeline: V placement needs `virtual_stages=2`, got {virtual_stages}.")
        return (pp_rank, 2 * pp - 1 - pp_rank)
    if placement != "loop":
        raise ValueError(f"pipeline: `placement={placement!r}` must be 'loop' or 'v'.")
    return tuple(pp_rank + s * pp for s in range(virtual_stages))


def stage_rank(stage: int, pp: int, num_stages: int, placement: str = "loop") -> int:
    """The pipeline rank that holds ``stage``."""
    if placement == "v":
        return stage if stage < pp else num_stages - 1 - stage
    return stage % pp


def theoretical_bubble(schedule: str, pp: int, microbatches: int, virtual_stages: int = 1) -> float:
    """Idle fraction of an ideal pipeline with equal-cost stages and free communication.

    GPipe and 1F1B: ``(p-1)/(m+p-1)`` (Huang et al. 2019; Narayanan et al. 2021 §2.2).
    Multi-stage (interleaved, looped BFS): ``(p-1)/(v·m+p-1)`` (Narayanan et al. 2021 §2.2.1). The
    zero-bubble schedules (interleaved_zero_bubble, zbv_zero_bubble, dualpipev) get the same
    interleaved figure as an upper bound: they fill part of it with weight-gradient (W) work.

    >>> round(theoretical_bubble("gpipe", 4, 8), 4), round(theoretical_bubble("interleaved_1f1b", 4, 8, 2), 4)
    (0.2727, 0.1579)
    """
    v = 1 if not schedule_spec(schedule).multi_stage else virtual_stages
    return (pp - 1) / (v * microbatches + pp - 1)


def _min_microbatches(spec: ScheduleSpec, num_stages: int) -> int:
    return num_stages if spec.min_microbatches == "stages" else 1


def _microbatches_problem(schedule: str, pp: int, v: int, batch_size: int, m: int) -> str | None:
    """Why ``m`` micro-batches cannot run, or None when they can."""
    spec = schedule_spec(schedule)
    if batch_size % m:
        return f"it must divide the per-rank batch size `batch_size={batch_size}` (equal micro-batches keep the loss exact)"
    low = _min_microbatches(spec, pp * v)
    if m < low:
        return f"`pp_schedule={schedule!r}` needs at least one micro-batch per stage ({low} stages)"
    if spec.cls in (ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble):
        rounds = max(1, m // pp)
        if m % rounds:
            return f"`pp_schedule={schedule!r}` runs rounds of pp={pp}; m must be a multiple of max(1, m // pp) = {rounds}"
    return None


def resolve_microbatches(
    schedule: str, pp: int, batch_size: int, microbatches: int | None = None, virtual_stages: int | None = None
) -> int:
    """Micro-batches per step: ``microbatches`` checked, or the default.

    The default is the smallest m ≥ 2·pp that divides ``batch_size`` and suits the schedule (enough
    micro-batches to keep the bubble under (p-1)/(3p-1)); if the batch is too small for that, the
    largest m that suits. An m below ``pp`` warns with the predicted bubble; an m that cannot run raises.

    >>> resolve_microbatches("1f1b", pp=4, batch_size=24)
    8
    """
    v = resolve_virtual_stages(schedule, virtual_stages)
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"pipeline: `batch_size={batch_size!r}` must be a positive int.")
    if microbatches is None:
        fits = [m for m in range(1, batch_size + 1) if _microbatches_problem(schedule, pp, v, batch_size, m) is None]
        if not fits:
            low = _min_microbatches(schedule_spec(schedule), pp * v)
            raise ValueError(
                f"pipeline: no micro-batch count suits `batch_size={batch_size}` with `pp_schedule={schedule!r}`, "
                f"`pp={pp}`, `pp_virtual_stages={v}`: it needs at least {low} equal micro-batches. "
                f"Use a per-rank batch size that is a multiple of {max(low, 2 * pp)}."
            )
        big = [m for m in fits if m >= 2 * pp]
        m = big[0] if big else fits[-1]
    else:
        if not isinstance(microbatches, int) or isinstance(microbatches, bool) or microbatches < 1:
            raise ValueError(f"pipeline: `pp_microbatches={microbatches!r}` must be a positive int.")
        m = microbatches
        problem = _microbatches_problem(schedule, pp, v, batch_size, m)
        if problem is not None:
            ok = [d for d in range(1, batch_size + 1) if _microbatches_problem(schedule, pp, v, batch_size, d) is None]
            raise ValueError(f"pipeline: `pp_microbatches={m}` cannot run: {problem}. Use one of {ok or 'none: change the batch size'}.")
    if m < pp:
        warnings.warn(
            f"pipeline: `pp_microbatches={m}` is below `pp={pp}`: each rank idles for about "
            f"{theoretical_bubble(schedule, pp, m, v):.0%} of the step (theoretical bubble). "
            f"Use m >= {2 * pp} micro-batches to bring it under {theoretical_bubble(schedule, pp, 2 * pp, v):.0%}.",
            UserWarning,
            stacklevel=2,
        )
    return m
