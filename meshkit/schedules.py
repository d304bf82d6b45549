"""Ground floor: the pipeline schedule vocabulary, its rules and the one bubble theory.

Imported by ``meshkit.plugins`` (the pipeline config checks, the planner) and by
``meshkit.profiling`` (``meshkit bubble``); it imports neither, nor torch.

- **Names** (:data:`SCHEDULE_NAMES`): torch.distributed.pipelining's, lower case. Other spellings
  in use are accepted (:data:`ALIASES`, any case, ``-`` or ``_``): "interleaved" is
  interleaved_1f1b; "zero-bubble" / "zero_bubble" / "zb-h1" is ZB-H1, i.e. interleaved_zero_bubble
  with one stage per rank. :func:`canonical_schedule` maps a spelling to its name.
- **Facts** (:data:`SCHEDULE_FACTS`): stages per rank and their placement, the smallest micro-batch
  count, the rounds rule, whether backward splits into input- and weight-gradient parts.
- **Rules**: :func:`resolve_virtual_stages`, :func:`microbatches_problem` (what torch accepts).
- **Theory**: :func:`step_time` and :func:`theoretical_bubble`, ideal equal-cost stages and free
  communication, checked against :func:`meshkit.profiling.bubble.simulate` replaying torch's own
  action orders (``tests/unit/test_schedules.py``).

>>> canonical_schedule("Zero-Bubble"), round(theoretical_bubble("zero_bubble", 4, 8), 4)
('interleaved_zero_bubble', 0.1111)
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "MICROBATCHES_PER_STAGE",
    "recommended_microbatches",
    "SCHEDULE_NAMES",
    "ALIASES",
    "ScheduleFacts",
    "SCHEDULE_FACTS",
    "canonical_schedule",
    "schedule_facts",
    "default_virtual_stages",
    "resolve_virtual_stages",
    "min_microbatches",
    "microbatches_problem",
    "step_time",
    "theoretical_bubble",
]

SCHEDULE_NAMES: tuple[str, ...] = (
    "gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble", "zbv_zero_bubble", "dualpipev",
)


@dataclass(frozen=True)
class ScheduleFacts:
    """What meshkit knows about one schedule beyond its torch class."""

    multi_stage: bool
    """True: several stages per rank (takes ``virtual_stages``); False: exactly one."""
    placement: str
    """"loop" (stage s on pp rank s % pp) or "v" (rank r holds stages r and 2·pp-1-r)."""
    min_microbatches: str
    """The smallest micro-batch count torch accepts: "1", or "stages" (one per stage)."""
    rounds: bool
    """torch's interleaved rule: m must be a multiple of max(1, m // pp)."""
    split_backward: bool
    """True: backward runs as input-gradient (I) then weight-gradient (W) actions."""


SCHEDULE_FACTS: dict[str, ScheduleFacts] = {
    "gpipe": ScheduleFacts(False, "loop", "1", False, False),
    "1f1b": ScheduleFacts(False, "loop", "stages", False, False),
    "interleaved_1f1b": ScheduleFacts(True, "loop", "1", True, False),
    "looped_bfs": ScheduleFacts(True, "loop", "1", False, False),
    "interleaved_zero_bubble": ScheduleFacts(True, "loop", "1", True, True),
    "zbv_zero_bubble": ScheduleFacts(True, "v", "stages", False, True),
    "dualpipev": ScheduleFacts(True, "v", "stages", False, True),
}

_ZB_H1 = ("zero-bubble", "zerobubble", "zb", "zbh1", "zb-h1", "zb1p")
ALIASES: dict[str, str] = {
    **{name.replace("_", "-"): name for name in SCHEDULE_NAMES},
    "interleaved": "interleaved_1f1b", "interleaved1f1b": "interleaved_1f1b",
    "loopedbfs": "looped_bfs", "zbv": "zbv_zero_bubble", "dualpipe-v": "dualpipev",
    **{alias: "interleaved_zero_bubble" for alias in _ZB_H1},
}
"""Accepted spellings (lower case, ``_`` read as ``-``) -> schedule name."""


def _key(schedule: str) -> str:
    return str(schedule).strip().lower().replace("_", "-")


def canonical_schedule(schedule: str, param: str = "schedule") -> str:
    """torch's name for ``schedule`` (any spelling in :data:`ALIASES`, any case); unknown names raise.

    >>> canonical_schedule("interleaved"), canonical_schedule("ZBV_zero_bubble")
    ('interleaved_1f1b', 'zbv_zero_bubble')
    """
    name = ALIASES.get(_key(schedule))
    if name is None:
        raise ValueError(
            f"`{param}={schedule!r}` is not a known schedule. Use one of {list(SCHEDULE_NAMES)} "
            f"(or an alias: 'interleaved', 'zero_bubble' for ZB-H1)."
        )
    return name


def schedule_facts(schedule: str, param: str = "schedule") -> ScheduleFacts:
    """The :class:`ScheduleFacts` of ``schedule`` (any accepted spelling)."""
    return SCHEDULE_FACTS[canonical_schedule(schedule, param)]


def default_virtual_stages(schedule: str) -> int:
    """Stages per rank when none is given: 1 for single-stage schedules and the ZB-H1 spellings, else 2."""
    if not schedule_facts(schedule).multi_stage or _key(schedule) in _ZB_H1:
        return 1
    return 2


def resolve_virtual_stages(schedule: str, virtual_stages: int | None) -> int:
    """Stages per rank: 1 for single-stage schedules, ``virtual_stages`` (default 2) for multi-stage ones.

    >>> resolve_virtual_stages("1f1b", None), resolve_virtual_stages("looped_bfs", 3)
    (1, 3)
    """
    name = canonical_schedule(schedule, "pp_schedule")
    facts = SCHEDULE_FACTS[name]
    if virtual_stages is not None and (not isinstance(virtual_stages, int) or virtual_stages < 1):
        raise ValueError(f"pipeline: `pp_virtual_stages={virtual_stages!r}` must be a positive int.")
    if not facts.multi_stage:
        if virtual_stages not in (None, 1):
            multi = [k for k in SCHEDULE_NAMES if SCHEDULE_FACTS[k].multi_stage]
            raise ValueError(
                f"pipeline: `pp_virtual_stages={virtual_stages}` needs a multi-stage schedule, but "
                f"`pp_schedule={schedule!r}` runs exactly one stage per rank. Drop pp_virtual_stages or use one of {multi}."
            )
        return 1
    v = default_virtual_stages(schedule) if virtual_stages is None else virtual_stages
    if facts.placement == "v" and v != 2:
        raise ValueError(
            f"pipeline: `pp_schedule={schedule!r}` places stages in a V and needs exactly 2 stages per rank; "
            f"got `pp_virtual_stages={v}`. Use pp_virtual_stages=2."
        )
    return v


MICROBATCHES_PER_STAGE = 2
"""The micro-batch rule meshkit recommends: m ≥ 2·p micro-batches for p pipeline ranks (the 1F1B bubble
(p − 1)/(m + p − 1) is then under a third; more micro-batches of a fixed batch shrink each GEMM). The pipeline's default
m and the doctor's warning read it (before issue 25 the doctor warned below 4p, seed 002's figure, while the pipeline
defaulted to 2p); what torch can run at all is :func:`microbatches_problem`, which the planner applies."""


def recommended_microbatches(pp: int) -> int:
    """The fewest micro-batches :data:`MICROBATCHES_PER_STAGE` recommends for ``pp`` pipeline ranks.

    >>> recommended_microbatches(4)
    8
    """
    return MICROBATCHES_PER_STAGE * pp


def min_microbatches(schedule: str, pp: int, virtual_stages: int = 1) -> int:
    """The fewest micro-batches torch runs ``schedule`` with: 1, or one per stage (pp · v)."""
    return pp * virtual_stages if schedule_facts(schedule).min_microbatches == "stages" else 1


def microbatches_problem(schedule: str, pp: int, virtual_stages: int, microbatches: int) -> str | None:
    """Why torch cannot run ``schedule`` with ``microbatches`` micro-batches, or None when it can.

    >>> microbatches_problem("interleaved_1f1b", 4, 2, 6) is None   # torch's rounds rule, not m % p
    True
    """
    low = min_microbatches(schedule, pp, virtual_stages)
    if microbatches < low:
        return f"`pp_schedule={schedule!r}` needs at least one micro-batch per stage ({low} stages)"
    rounds = max(1, microbatches // pp)
    if schedule_facts(schedule).rounds and microbatches % rounds:
        return f"`pp_schedule={schedule!r}` runs rounds of pp={pp}; m must be a multiple of max(1, m // pp) = {rounds}"
    return None


def step_time(schedule: str, pp: int, microbatches: int, virtual_stages: int = 1, *,
              tf: float = 1.0, tb: float = 1.0, tw: float = 1.0) -> tuple[float, float]:
    """``(total, ideal)``: one rank's step time and its compute, for equal stages and free communication.

    ``tf``, ``tb``, ``tw``: forward, input-gradient and weight-gradient time of one micro-batch over
    all of a rank's layers (each of its v stages takes 1/v of that); schedules that do not split the
    backward run ``tb + tw`` as one action. ideal = m(tf + tb + tw); total = ideal + bubble:

    - gpipe, 1f1b: (p-1)(tf+tb+tw) (Huang et al. 2019; Narayanan et al. 2021 §2.2).
    - interleaved_1f1b, looped_bfs: [(p-1) + (v-1)·max(0, p-m)]·(tf+tb+tw)/v. For m ≥ p this is
      Narayanan et al. 2021 §2.2.2's (p-1)/v; below p micro-batches each later chunk round also
      waits p-m slots (found with the simulator on torch's orders, exact for every m).
    - interleaved_zero_bubble, zbv_zero_bubble, dualpipev: ZB-H1's (p-1)(tf+tb-tw)/v (Qi et al. 2024
      §3.1, per stage), plus max(0, p-m)·tw: with fewer than p micro-batches there are too few W to
      fill the warm-up. Torch's orders reach it for m ≥ p (V schedules need m ≥ 2p anyway); for
      interleaved_zero_bubble with v ≥ 2 and 2m < p it is a lower bound.

    >>> step_time("1f1b", 4, 8, tf=1, tb=1, tw=1)
    (33.0, 24.0)
    """
    name = canonical_schedule(schedule)
    p, m = pp, microbatches
    v = virtual_stages if SCHEDULE_FACTS[name].multi_stage else 1
    for label, value in (("pp", p), ("microbatches", m), ("virtual_stages", v)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"`{label}={value!r}` must be an int >= 1.")
    ideal = m * (tf + tb + tw)
    if SCHEDULE_FACTS[name].split_backward:
        if tw > tf + tb:
            raise ValueError(f"`tw={tw}` > `tf + tb = {tf + tb}`: ZB-H1's formula assumes W ≤ F + B.")
        bubble = (p - 1) * (tf + tb - tw) / v + max(0, p - m) * tw
    else:
        bubble = ((p - 1) + (v - 1) * max(0, p - m)) * (tf + tb + tw) / v
    return float(ideal + bubble), float(ideal)


def theoretical_bubble(schedule: str, pp: int, microbatches: int, virtual_stages: int = 1, *,
                       tf: float = 1.0, tb: float = 1.0, tw: float = 1.0) -> float:
    """Idle fraction of an ideal pipeline: equal stages, free communication; by default forward =
    input-gradient = weight-gradient time (backward = 2 × forward). ``tf``, ``tb``, ``tw`` as in
    :func:`step_time` (a schedule that does not split its backward runs ``tb + tw`` as one, so ``tw=0``
    makes ``tb`` the full backward). ``virtual_stages`` is ignored by single-stage schedules.
    The one bubble theory: the planner, the pipeline config warning, the doctor and ``meshkit bubble`` call it.

    GPipe/1F1B (p-1)/(m+p-1); interleaved and looped BFS (p-1)/(v·m+p-1) for m ≥ p; the zero-bubble
    family (p-1)/(3·v·m+p-1) for m ≥ p. Formulas and sources: :func:`step_time`.

    >>> round(theoretical_bubble("gpipe", 4, 8), 4), round(theoretical_bubble("interleaved_1f1b", 4, 8, 2), 4)
    (0.2727, 0.1579)
    """
    total, ideal = step_time(schedule, pp, microbatches, virtual_stages, tf=tf, tb=tb, tw=tw)
    return (total - ideal) / total
