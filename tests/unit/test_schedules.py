"""One schedule vocabulary, one bubble theory: every user agrees, and the theory matches the simulator
replaying torch's own action orders."""

from __future__ import annotations

import argparse
import json
import warnings

import pytest
import torch

from meshkit import schedules as S
from meshkit import planner
from meshkit.plugins.pipeline import SCHEDULES, resolve_microbatches, theoretical_bubble
from meshkit.profiling import bubble as B


def test_names_aliases_and_errors():
    assert tuple(SCHEDULES) == S.SCHEDULE_NAMES
    for spelling, name in [("Interleaved", "interleaved_1f1b"), ("zero-bubble", "interleaved_zero_bubble"),
                           ("ZERO_BUBBLE", "interleaved_zero_bubble"), ("zbv-zero-bubble", "zbv_zero_bubble"),
                           ("1F1B", "1f1b"), ("DualPipeV", "dualpipev")]:
        assert S.canonical_schedule(spelling) == name
    with pytest.raises(ValueError, match=r"`schedule='pipedream'` is not a known schedule. Use one of \['gpipe'"):
        S.canonical_schedule("pipedream")
    # ZB-H1 spellings mean one stage per rank; torch's name defaults to 2 like every multi-stage schedule.
    assert S.resolve_virtual_stages("zero_bubble", None) == 1
    assert S.resolve_virtual_stages("interleaved_zero_bubble", None) == 2


def _legal_for_torch(schedule: str, p: int, m: int, v: int) -> bool:
    facts = S.SCHEDULE_FACTS[schedule]
    if (not facts.multi_stage and v != 1) or (facts.placement == "v" and v != 2):
        return False
    return S.microbatches_problem(schedule, p, v, m) is None


def _profiling(schedule: str, p: int, m: int, v: int) -> argparse.Namespace | None:
    """``meshkit bubble`` arguments at F = I = W (full B = 2F), or None where its simulator's stricter
    interleaved rule (m a multiple of p) refuses them."""
    if schedule == "interleaved_1f1b" and m % p:
        return None
    times = dict(tf=1.0, tb=1.0, tw=1.0) if S.SCHEDULE_FACTS[schedule].split_backward else dict(tf=1.0, tb=2.0)
    parser = argparse.ArgumentParser()
    B.configure_parser(parser)
    flags = [x for k, t in times.items() for x in (f"--{k}", str(t))]
    return parser.parse_args(["--schedule", schedule, "-p", str(p), "-m", str(m), "-v", str(v), "--json", *flags])


@pytest.mark.parametrize("schedule", S.SCHEDULE_NAMES)
def test_three_users_agree(schedule, capsys):
    # The pipeline config check (plugins), the planner's bubble_fraction and profiling.bubble / `meshkit bubble`.
    checked = 0
    for p in (2, 4, 8):
        for m in (4, 8, 16):
            for v in (1, 2):
                if not _legal_for_torch(schedule, p, m, v):
                    continue
                want = S.theoretical_bubble(schedule, p, m, v)
                assert theoretical_bubble(schedule, p, m, v) == want
                if m < p:  # the config check quotes the same figure
                    with pytest.warns(UserWarning, match=f"idles for about {want:.0%}"):
                        resolve_microbatches(schedule, p, m, m, v)
                else:
                    with warnings.catch_warnings():
                        warnings.simplefilter("error")
                        resolve_microbatches(schedule, p, m, m, v)
                if schedule in planner.PLANNED_SCHEDULES:
                    assert planner.bubble_fraction(schedule, p, m, v) == pytest.approx(want, abs=1e-12)
                args = _profiling(schedule, p, m, v)
                if args is not None:
                    assert B.run_cli(args) == 0
                    out = json.loads(capsys.readouterr().out)
                    assert out["theoretical_bubble_fraction"] == pytest.approx(want, abs=1e-12)
                    if "bubble_fraction" in out:  # simulated by profiling's built-in order
                        assert out["bubble_fraction"] == pytest.approx(want, abs=1e-9)
                checked += 1
    assert checked > 0


def test_planner_and_profiling_spellings():
    # p=4, m=8: the 0.158 / 0.158 / 0.111; at F = I = W ZB-H1 is 3/27 everywhere.
    zb = S.theoretical_bubble("interleaved_zero_bubble", 4, 8)
    assert zb == pytest.approx(3 / 27)
    assert planner.bubble_fraction("zero_bubble", 4, 8) == zb
    assert B.theoretical_bubble is S.theoretical_bubble and theoretical_bubble is S.theoretical_bubble  # one function
    assert B.theoretical_bubble("zero-bubble", 4, 8) == zb
    assert theoretical_bubble("zero_bubble", 4, 8) == zb
    # torch's interleaved_zero_bubble at its default v=2: (p-1)/(3·v·m+p-1) = 3/51, not the interleaved 3/19.
    assert theoretical_bubble("interleaved_zero_bubble", 4, 8, 2) == pytest.approx(3 / 51)


# ---- the theory against meshkit's simulator on torch's own orders ------------------------------------


class _FakeStage:
    """Just what torch's multi-stage schedules read to build their per-rank action order."""

    def __init__(self, index: int, num_stages: int, pp: int) -> None:
        self.stage_index, self.num_stages, self.group_size, self.group_rank = index, num_stages, pp, 0
        self.is_first, self.is_last = index == 0, index == num_stages - 1
        self.submod, self.has_backward = None, True


_KIND = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W"}


def _torch_orders(schedule: str, p: int, m: int, v: int) -> list[list[B.Action]]:
    """torch's per-rank compute order (``schedule.pipeline_order``), as simulator actions; a full B
    inside a split schedule becomes I then W. Reads torch's ``_Action`` fields (checked on torch 2.13)."""
    from meshkit.plugins.pipeline import schedule_spec, stage_ids_on_rank

    spec = schedule_spec(schedule)
    stages = [_FakeStage(s, p * v, p) for s in stage_ids_on_rank(0, p, v, spec.placement)]
    try:
        order = spec.cls(stages, n_microbatches=m).pipeline_order
    except (AttributeError, TypeError) as exc:  # torch changed what a schedule reads from its stages
        pytest.skip(f"torch {torch.__version__}: cannot build {schedule}'s order from fake stages ({exc})")
    split = S.SCHEDULE_FACTS[schedule].split_backward
    out = []
    for r in range(p):
        acts = []
        for a in filter(None, order[r]):
            for sub in getattr(a, "sub_actions", None) or (a,):  # DualPipeV's overlapped F+B
                kind = _KIND[sub.computation_type.name]
                kinds = ("I", "W") if split and kind == "B" else (kind,)
                acts += [B.Action(k, sub.microbatch_index, sub.stage_index) for k in kinds]
        out.append(acts)
    return out


@pytest.mark.parametrize("schedule", [s for s in S.SCHEDULE_NAMES if S.SCHEDULE_FACTS[s].multi_stage])
def test_theory_matches_simulated_torch_orders(schedule):
    split = S.SCHEDULE_FACTS[schedule].split_backward
    for p in (2, 4):
        for v in ((2,) if S.SCHEDULE_FACTS[schedule].placement == "v" else (1, 2, 3)):
            for m in range(1, 2 * p + 3):
                if not _legal_for_torch(schedule, p, m, v) or (split and v > 1 and 2 * m < p):
                    continue  # ZB with v >= 2 and 2m < p: the theory is a lower bound there
                orders = _torch_orders(schedule, p, m, v)
                sim = B.simulate(orders, tf=1.0, tb=1.0 if split else 2.0, tw=1.0)
                assert sim.bubble_fraction == pytest.approx(S.theoretical_bubble(schedule, p, m, v), abs=1e-9), \
                    (schedule, p, m, v)
    if schedule == "interleaved_zero_bubble":  # p=8, v=2, m=3: torch idles 19 of 67 chunk-actions, theory 17 of 65
        sim = B.simulate(_torch_orders(schedule, 8, 3, 2), tf=1.0, tb=1.0, tw=1.0)
        assert sim.bubble_fraction > S.theoretical_bubble(schedule, 8, 3, 2)


def test_zero_bubble_below_p_microbatches_matches_simulator():
    # ZB-H1 (profiling's built-in order) with m < p: only m-1 W can fill the warm-up, (p-m)·W more idle.
    for p, m, tw in [(4, 1, 1.0), (4, 2, 1.0), (4, 3, 0.5), (8, 5, 0.5)]:
        sim = B.simulate("zero-bubble", p, m, tf=1, tb=1, tw=tw)
        assert sim.total_time == pytest.approx(S.step_time("zero-bubble", p, m, tf=1, tb=1, tw=tw)[0])
