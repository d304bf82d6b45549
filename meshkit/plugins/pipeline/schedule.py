"""Pipeline schedules on torch: the class of each name, stage placement, micro-batch resolution.

The vocabulary, its rules and the bubble theory live in :mod:`meshkit.schedules` (shared with the
planner and ``meshkit bubble``); this module adds what needs torch or a batch size.
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

from meshkit.schedules import (
    SCHEDULE_FACTS,
    ScheduleFacts,
    canonical_schedule,
    microbatches_problem,
    min_microbatches,
    recommended_microbatches,
    resolve_virtual_stages,
    theoretical_bubble,
)

__all__ = [
    "SCHEDULES",
    "ScheduleSpec",
    "schedule_spec",
    "resolve_virtual_stages",
    "resolve_microbatches",
    "stage_ids_on_rank",
    "stage_rank",
    "theoretical_bubble",
]


@dataclass(frozen=True)
class ScheduleSpec:
    """A schedule's torch class beside its facts (:class:`meshkit.schedules.ScheduleFacts`)."""

    cls: type
    """The torch.distributed.pipelining schedule class."""
    facts: ScheduleFacts
    """Stages per rank, placement, micro-batch rules (the ground floor's record)."""

    @property
    def multi_stage(self) -> bool:
        return self.facts.multi_stage

    @property
    def placement(self) -> str:
        return self.facts.placement

    @property
    def min_microbatches(self) -> str:
        return self.facts.min_microbatches


_CLASSES: dict[str, type] = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
    "looped_bfs": ScheduleLoopedBFS,
    "interleaved_zero_bubble": ScheduleInterleavedZeroBubble,
    "zbv_zero_bubble": ScheduleZBVZeroBubble,
    "dualpipev": ScheduleDualPipeV,
}

SCHEDULES: dict[str, ScheduleSpec] = {
    name: ScheduleSpec(cls, SCHEDULE_FACTS[name]) for name, cls in _CLASSES.items()
}
"""torch's schedule names -> :class:`ScheduleSpec` (the names of :data:`meshkit.schedules.SCHEDULE_NAMES`)."""


def schedule_spec(schedule: str) -> ScheduleSpec:
    """The :class:`ScheduleSpec` of ``schedule`` (any spelling :func:`meshkit.schedules.canonical_schedule` accepts)."""
    try:
        return SCHEDULES[canonical_schedule(schedule, "pp_schedule")]
    except ValueError as exc:
        raise ValueError(f"pipeline: {exc}") from None


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


def _microbatches_problem(schedule: str, pp: int, v: int, batch_size: int, m: int) -> str | None:
    """Why ``m`` micro-batches cannot run on a per-rank batch of ``batch_size``, or None when they can."""
    if batch_size % m:
        return f"it must divide the per-rank batch size `batch_size={batch_size}` (equal micro-batches keep the loss exact)"
    return microbatches_problem(schedule, pp, v, m)


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
            low = min_microbatches(schedule, pp, v)
            raise ValueError(
                f"pipeline: no micro-batch count suits `batch_size={batch_size}` with `pp_schedule={schedule!r}`, "
                f"`pp={pp}`, `pp_virtual_stages={v}`: it needs at least {low} equal micro-batches. "
                f"Use a per-rank batch size that is a multiple of {max(low, recommended_microbatches(pp))}."
            )
        big = [m for m in fits if m >= recommended_microbatches(pp)]  # meshkit's one micro-batch rule
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
            f"Use m >= {recommended_microbatches(pp)} micro-batches to bring it under "
            f"{theoretical_bubble(schedule, pp, recommended_microbatches(pp), v):.0%}.",
            UserWarning,
            stacklevel=2,
        )
    return m
