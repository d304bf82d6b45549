"""Pipeline bubble: closed forms, the simulator and the measured bubble, against hand values."""

from __future__ import annotations

import argparse
import json
import re

import pytest

from meshkit import schedules as S
from meshkit.profiling import bubble as B
from meshkit.profiling.bubble import Action, TimelineRecord, measured_bubble, simulate


def test_gpipe_and_1f1b_by_hand():
    # p=4, m=8, F=1, B=2: the last microbatch leaves stage 0 after (m+p-1) slots of (F+B) = 33;
    # each stage works m·(F+B) = 24, so idle ÷ total = 9/33 = (p-1)/(m+p-1).
    for sched in ("gpipe", "1f1b"):
        th = S.step_time(sched, 4, 8, tf=1, tb=2, tw=0), S.theoretical_bubble(sched, 4, 8, tf=1, tb=2, tw=0)
        sim = simulate(sched, 4, 8, tf=1, tb=2)
        assert th == ((33.0, 24.0), 9 / 33)
        assert (sim.total_time, sim.ideal_time) == (33.0, 24.0)
        assert sim.bubble_fraction == pytest.approx(9 / 33)
    # memory: GPipe holds all m microbatches; 1F1B holds p - r on rank r.
    assert simulate("gpipe", 4, 8).peak_inflight_microbatches == [8, 8, 8, 8]
    assert simulate("1f1b", 4, 8).peak_inflight_microbatches == [4, 3, 2, 1]


def test_interleaved_by_hand():
    # v=2 chunks of F/2, B/2: the fill/drain costs (p-1)/v slots: total = (m + (p-1)/v)(F+B).
    # p=4, m=8, F=1, B=2: (8 + 1.5) · 3 = 28.5, bubble 4.5/28.5 = (p-1)/(v·m+p-1) = 3/19.
    total, _ = S.step_time("interleaved", 4, 8, 2, tf=1, tb=2, tw=0)
    assert total == 28.5 and S.theoretical_bubble("interleaved", 4, 8, 2, tf=1, tb=2, tw=0) == pytest.approx(3 / 19)
    sim = simulate("interleaved", 4, 8, virtual=2, tf=1, tb=2)
    assert sim.total_time == pytest.approx(28.5) and sim.bubble_fraction == pytest.approx(3 / 19)
    sim = simulate("interleaved", 2, 4, virtual=2, tf=1, tb=1)
    assert sim.total_time == pytest.approx(9.0)  # (4 + 1/2) · 2


def test_zero_bubble_by_hand():
    # p=2, m=2, F=I=W=1. Rank 1: F0[1,2] I0[2,3] F1[3,4] I1[4,5]; it may keep 1 W pending, so
    # W0 waits, then W0[5,6] W1[6,7]. Rank 0: F0[0,1] F1[1,2], waits for I0 (done at 3): I0[3,4],
    # waits for I1 (done at 5) and fills [4,5] with W0, I1[5,6], W1[6,7]. Total 7 =
    # m(F+I+W) + (p-1)(F+I-W) = 6 + 1 (ZB-H1).
    sim = simulate("zero-bubble", 2, 2, tf=1, tb=1, tw=1)
    assert sim.total_time == 7.0
    assert S.step_time("zero-bubble", 2, 2, tf=1, tb=1, tw=1)[0] == 7.0
    rank0 = [(a.kind + str(a.microbatch), s, e) for a, s, e in sim.timeline[0]]
    assert rank0 == [("F0", 0, 1), ("F1", 1, 2), ("I0", 3, 4), ("W0", 4, 5), ("I1", 5, 6), ("W1", 6, 7)]
    for p, m, tw in [(4, 8, 1.0), (4, 8, 0.5), (3, 9, 1.0)]:
        total, _ = S.step_time("zero-bubble", p, m, tf=1, tb=1, tw=tw)
        sim = simulate("zero-bubble", p, m, tf=1, tb=1, tw=tw)
        assert sim.total_time == pytest.approx(total)
        assert sim.peak_inflight_microbatches == [p] * p  # ZB-H1 keeps 1F1B's first-stage memory


def test_heterogeneous_stages_by_hand():
    # p=2, m=2, stage 0: F=1 B=2; stage 1: F=2 B=4.
    # rank 1: F0[1,3] B0[3,7] F1[7,9] B1[9,13]; rank 0: F0[0,1] F1[1,2] B0[7,9] B1[13,15].
    sim = simulate("1f1b", 2, 2, tf=[1, 2], tb=[2, 4])
    assert sim.total_time == 15.0
    assert sim.bubble_fraction == pytest.approx(((15 - 6) + (15 - 12)) / 30)
    assert sim.ideal_time == 12.0


def test_orders_and_deadlock():
    assert [f"{a.kind}{a.microbatch}" for a in B.schedule_orders("1f1b", 2, 3)[1]] == \
        ["F0", "B0", "F1", "B1", "F2", "B2"]
    bad = [[Action("B", 0, 0), Action("F", 0, 0)], [Action("F", 0, 1), Action("B", 0, 1)]]
    with pytest.raises(ValueError, match="deadlocks"):
        simulate(bad)


@pytest.mark.parametrize("kwargs, match", [
    (dict(schedule="foo", stages=2, microbatches=2), r"schedule='foo'` is unknown"),
    (dict(schedule="interleaved", stages=4, microbatches=6, virtual=2), r"microbatches=6`.*multiple of `stages=4`"),
    (dict(schedule="1f1b", stages=4, microbatches=8, virtual=2), r"virtual=2`.*interleaved"),
    (dict(schedule="zero-bubble", stages=4, microbatches=8), r"tw=None"),
    (dict(schedule="1f1b", stages=0, microbatches=8), r"stages=0"),
    (dict(schedule="1f1b", stages=2, microbatches=2, tf=0), r"tf=0"),
])
def test_bad_input(kwargs, match, capsys):
    from meshkit.cli import main

    flags = {"schedule": "--schedule", "stages": "-p", "microbatches": "-m", "virtual": "-v", "tf": "--tf"}
    argv = ["bubble"] + [x for k, v in kwargs.items() for x in (flags[k], str(v))]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("meshkit bubble: error: ") and re.search(match, err), err


def _records_from(sim, step, scale=1000):
    return [TimelineRecord(step, r, a.stage, a.microbatch, a.kind, int(s * scale), int(e * scale))
            for r, tl in enumerate(sim.timeline) for a, s, e in tl]


def test_measured_bubble_by_hand_and_replay():
    # one step, 2 ranks: rank 0 F0[0,10] B0[30,50]; rank 1 F0[10,20] B0[20,30].
    # span 50; idle 20 + 30 = 50 of 100 -> 0.5.
    recs = [TimelineRecord(0, 0, 0, 0, "F", 0, 10), TimelineRecord(0, 0, 0, 0, "B", 30, 50),
            TimelineRecord(0, 1, 1, 0, "F", 10, 20), TimelineRecord(0, 1, 1, 0, "B", 20, 30)]
    m = measured_bubble(recs)
    assert m.bubble_fraction == 0.5 and m.step_time_ns == 50
    assert m.per_rank[0].idle_ns == 20 and m.per_rank[1].idle_ns == 30
    # A recorded 1F1B run with exactly the simulator's times measures the simulator's bubble,
    # and replaying it reproduces it.
    sim = simulate("1f1b", 4, 8, tf=1, tb=2)
    recs = _records_from(sim, 0) + [TimelineRecord(1, r.rank, r.stage, r.microbatch, r.action,
                                                   r.start_ns + 10**6, r.end_ns + 10**6)
                                    for r in _records_from(sim, 0)]
    assert measured_bubble(recs).bubble_fraction == pytest.approx(9 / 33)
    assert B.simulate_from_timeline(recs).bubble_fraction == pytest.approx(9 / 33)


def test_hop_latency_by_hand():
    # p=2, m=1, F=1, B=1, every P2P hop 0.5: r0 F0[0,1]; r1 F0[1.5,2.5] B0[2.5,3.5]; r0 B0[4,5].
    # total 5, each rank busy 2: idle (3 + 3) / (2 · 5) = 0.6.
    sim = simulate("1f1b", 2, 1, tf=1, tb=1, comm=0.5)
    assert sim.total_time == 5.0 and sim.bubble_fraction == pytest.approx(0.6)
    with pytest.raises(ValueError, match="comm=-1"):
        simulate("1f1b", 2, 1, comm=-1)
    # That run as a record (ns): two waits on the other rank, each 0.5 -> median 0.5; rank 1's B0
    # follows its own F0 (same rank) and is not a hop. Replaying with the measured hop gives 0.6,
    # with free communication (the default) 1 - 4/(2·4) = 0.5.
    recs = [TimelineRecord(0, 0, 0, 0, "F", 0, 10), TimelineRecord(0, 1, 1, 0, "F", 15, 25),
            TimelineRecord(0, 1, 1, 0, "B", 25, 35), TimelineRecord(0, 0, 0, 0, "B", 40, 50)]
    assert B.hop_latency_ns(recs) == 5.0
    assert B.simulate_from_timeline(recs, comm="measured").bubble_fraction == pytest.approx(0.6)
    assert B.simulate_from_timeline(recs).bubble_fraction == pytest.approx(0.5)
    # A consumer still busy with its own previous action when the input arrived did not wait: skipped.
    # Rank 1's F0 waited for rank 0's F0 (ended 10) and began at 12: a 2 ns hop. Its F1 began at
    # 32, 12 after rank 0's F1 ended, but rank 1 was busy with F0 until 30: not a hop, so 2.0.
    busy = [TimelineRecord(0, 0, 0, 0, "F", 0, 10), TimelineRecord(0, 0, 0, 1, "F", 10, 20),
            TimelineRecord(0, 1, 1, 0, "F", 12, 30), TimelineRecord(0, 1, 1, 1, "F", 32, 40)]
    assert B.hop_latency_ns(busy) == 2.0
    with pytest.raises(ValueError, match="comm='fast'"):
        B.simulate_from_timeline(recs, comm="fast")


def test_read_timeline(tmp_path):
    d = tmp_path / "pp_timeline"
    d.mkdir()
    rec = dict(step=0, rank=0, stage=0, microbatch=0, action="F", start_ns=0, end_ns=5)
    text = json.dumps(rec) + "\n" + json.dumps({**rec, "action": "B", "start_ns": 5, "end_ns": 9}) + "\n"
    (d / "pp_timeline_rank0.jsonl").write_text(text + '{"step": 0, "ra')  # cut off mid-write
    (d / "pp_timeline_rank1.jsonl").write_text(json.dumps({**rec, "rank": 1, "stage": 1}) + "\n")
    recs = B.read_timeline(str(d))
    assert len(recs) == 3 and {r.rank for r in recs} == {0, 1}
    assert B.find_timeline_dir(str(tmp_path)) == str(d)
    (d / "pp_timeline_rank1.jsonl").write_text("not json\n" + json.dumps(rec) + "\n")
    with pytest.raises(ValueError, match=r"pp_timeline_rank1.jsonl:1 is not valid JSON"):
        B.read_timeline(str(d))
    (d / "pp_timeline_rank1.jsonl").write_text(json.dumps({**rec, "action": "X"}) + "\n")
    with pytest.raises(ValueError, match=r"action='X'.*F, B, I or W"):
        B.read_timeline(str(d))
    (d / "pp_timeline_rank1.jsonl").write_text(json.dumps({**rec, "start_ns": "0"}) + "\n")
    with pytest.raises(ValueError, match=r"start_ns='0'.*int"):
        B.read_timeline(str(d))
    with pytest.raises(ValueError, match="does not exist"):
        B.read_timeline(str(tmp_path / "none"))


def _write_run(log_dir):
    """A recorded run in ``log_dir``: 1F1B p=2 m=4 at F=1 ms, B=2 ms, two steps 100 ms apart; its SimResult."""
    d = log_dir / "pp_timeline"
    d.mkdir(parents=True)
    sim = simulate("1f1b", 2, 4, tf=1, tb=2)
    for r in range(2):
        with open(d / f"pp_timeline_rank{r}.jsonl", "w") as f:
            for step in range(2):
                for rec in _records_from(sim, step, scale=10**6):
                    if rec.rank == r:
                        f.write(json.dumps({**rec.__dict__, "start_ns": rec.start_ns + step * 10**8,
                                            "end_ns": rec.end_ns + step * 10**8}) + "\n")
    return sim


def test_gantt_and_cli(tmp_path, capsys):
    fig = B.gantt_figure(simulate("1f1b", 4, 8))
    assert len(fig.axes[0].get_yticks()) == 4
    p = argparse.ArgumentParser()
    B.configure_parser(p)
    png = tmp_path / "g.png"
    assert B.run_cli(p.parse_args(["--schedule", "interleaved", "-p", "4", "-m", "8", "-v", "2", "--tf", "1",
                                   "--tb", "2", "--json", "--gantt", str(png)])) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["total_time"] == pytest.approx(28.5)
    assert out["bubble_fraction"] == pytest.approx(3 / 19)
    assert len(out["peak_inflight_microbatches"]) == 4 and png.stat().st_size > 1000
    from meshkit.cli import main  # user errors: the one catch in meshkit.cli

    assert main(["bubble", "--schedule", "zero-bubble", "-p", "4", "-m", "8"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("meshkit bubble: error: ") and "tw" in err
    # measured: a recorded run
    sim = _write_run(tmp_path / "run")
    assert B.run_cli(p.parse_args(["--timeline", str(tmp_path / "run"), "--json"])) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["measured_bubble_fraction"] == pytest.approx(sim.bubble_fraction)
    assert out["simulated_bubble_fraction"] == pytest.approx(sim.bubble_fraction)


_LONG_FLOAT = r"\d\.\d{5,}"  # what the text output printed before: 0.2727272727272727


def test_cli_text_has_units_and_percent(tmp_path, capsys):
    p = argparse.ArgumentParser()
    B.configure_parser(p)
    assert B.run_cli(p.parse_args(["-p", "4", "-m", "8"])) == 0
    text = capsys.readouterr().out
    assert not re.search(_LONG_FLOAT, text), text
    # 1f1b p=4 m=8 F=1 B=2: total 33, busiest rank 24, bubble 9/33 = 27.27 % (theory and simulator)
    assert re.search(r"step time, simulated: 33 ms$", text, re.M)
    assert re.search(r"busiest rank's compute: 24 ms$", text, re.M)
    assert re.search(r"bubble, simulated: 27\.27 %$", text, re.M)
    assert re.search(r"bubble, closed form: 27\.27 %$", text, re.M)
    assert re.search(r"peak in-flight microbatches per rank: 4, 3, 2, 1$", text, re.M)
    assert B.run_cli(p.parse_args(["-p", "4", "-m", "8", "--tf", "1500", "--tb", "3000", "--unit", "us"])) == 0
    assert re.search(r"step time, closed form: 49\.5 ms$", capsys.readouterr().out, re.M)  # 33 × 1.5 ms
    # a recorded run (times in ns on disk): 1F1B p=2 m=4 at F=1 ms, B=2 ms -> span 15 ms, bubble 3/15 = 20 %
    sim = _write_run(tmp_path / "run")
    assert B.run_cli(p.parse_args(["--timeline", str(tmp_path / "run")])) == 0
    text = capsys.readouterr().out
    assert not re.search(_LONG_FLOAT, text), text
    assert sim.total_time == 15 and sim.bubble_fraction == pytest.approx(0.2)
    assert re.search(r"step time, measured \(mean\): 15 ms$", text, re.M)
    assert re.search(r"bubble, measured: 20\.00 %$", text, re.M)
    assert re.search(r"bubble per step, measured: step 1: 20\.00 %$", text, re.M)
    assert "time_unit" not in text


def test_format_time_rescales_known_units():
    assert B.format_time(0.25, "ms") == "250 us"
    assert B.format_time(2.5e6, "ns") == "2.5 ms"
    assert B.format_time(12345.678, "ms") == "12.35 s"
    assert B.format_time(0, "ms") == "0 ms"
    assert B.format_fraction(3 / 19) == "15.79 %"
