"""`meshkit analyze` on traces with bad complete events: counted per rank, file and reason, skipped
(never read as zeros), reported in the text and JSON output; a file with only bad events is an error.

The good events are tests/unit/test_trace.py's two-rank CPU trace, whose figures are derived by hand
there; with bad events mixed in, every figure must stay exactly what the clean trace gives."""

from __future__ import annotations

import json

import pytest

from meshkit.cli import main
from meshkit.profiling.trace import BAD_EVENT_REASONS, load_trace
from tests.unit.test_trace import BASE, X, cpu_rank, cuda_rank, write_trace

# Each would change the figures if it were read as a number (or as 0): they sit in rank 0's idle
# [70, 100) µs of step 1 and rank 1's compute-free comm window.
BAD_RANK0 = [  # Kineto's layout, read by the typed fast path (a string fits it): the batch check finds these
    X("aten::mm", "cpu_op", 75, -10, 1),                                       # dur negative
    {k: v for k, v in X("aten::mm", "cpu_op", 72, 20, 1).items() if k != "dur"},  # dur missing
    dict(X("gloo:all_reduce", "user_annotation", 80, 15, 2), dur=None),         # dur missing (null)
    dict(X("aten::mm", "cpu_op", 85, 5, 1), dur="5"),                           # dur not a number (a string)
]
BAD_RANK1 = [  # a NaN makes msgspec refuse the batch: the stdlib decodes it, every event is checked
    dict(X("aten::mm", "cpu_op", 72, 20, 1), ts=str(BASE + 72)),   # ts not a number (a string)
    dict(X("aten::mm", "cpu_op", 60, 10, 1), dur=float("nan")),    # dur not finite
    dict(X("aten::mm", "cpu_op", 0, 10, 1), ts=True),               # ts not a number (a bool)
]


def _run(capsys, *argv):
    code = main(["analyze", *map(str, argv)])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture
def dirs(tmp_path):
    clean, bad = tmp_path / "clean", tmp_path / "bad"
    for d, extra in ((clean, ([], [])), (bad, (BAD_RANK0, BAD_RANK1))):
        d.mkdir()
        for r in (0, 1):
            ev = cpu_rank(r)
            write_trace(d / f"rank{r}.1.pt.trace.json", r, 2, ev[:3] + extra[r] + ev[3:])  # not last: fast path
    return clean, bad


def test_bad_events_are_skipped_counted_and_reported(dirs, capsys):
    clean, bad = dirs
    code, out, err = _run(capsys, clean, "--json")
    assert code == 0 and not err
    want = json.loads(out)
    assert not want["partial"] and want["bad_events"] == [] and want["ranks"]["0"]["bad_events"] == 0
    assert want["ranks"]["0"]["compute_ms"] == pytest.approx(0.110)  # test_trace's hand-derived figure

    code, out, err = _run(capsys, bad, "--json")
    assert code == 0
    got = json.loads(out)
    assert got["partial"]
    for r, n in (("0", 4), ("1", 3)):  # the same figures as the clean trace: skipped, not zeroed
        assert {k: v for k, v in got["ranks"][r].items() if k not in ("partial", "bad_events")} == \
            {k: v for k, v in want["ranks"][r].items() if k not in ("partial", "bad_events")}
        assert got["ranks"][r]["partial"] and got["ranks"][r]["bad_events"] == n
    b0, b1 = got["bad_events"]
    assert (b0["rank"], b0["window"], b0["file"], b0["count"], b0["complete"]) == (0, 1, "rank0.1.pt.trace.json", 4, 13)
    assert b0["reasons"] == {"dur missing": 2, "dur negative": 1, "dur not a number": 1}
    assert b0["first"].startswith('dur negative: {"ph": "X", "cat": "cpu_op", "name": "aten::mm"')
    assert b0["first"].endswith('"dur": -10.0}')
    assert (b1["rank"], b1["count"], b1["complete"]) == (1, 3, 12)
    assert b1["reasons"] == {"dur not finite": 1, "ts not a number": 2}
    assert b1["first"].startswith("ts not a number: ") and f'"ts": "{BASE + 72}"' in b1["first"]
    assert set(b0["reasons"]) | set(b1["reasons"]) <= set(BAD_EVENT_REASONS)
    msg0 = ("rank 0, window 1: rank0.1.pt.trace.json: skipped 4 of 13 complete events as bad "
            "(2 dur missing, 1 dur negative, 1 dur not a number); first: dur negative: ")
    assert b0["message"].startswith(msg0)
    assert any(p.endswith(b0["message"].split(": ", 1)[1]) for p in got["problems"])
    assert err.startswith("meshkit analyze: warning: partial result (") and "7 bad trace events skipped" in err

    code, text, err = _run(capsys, bad)  # the text output: a warning line per file, first thing
    assert code == 0 and "7 bad trace events skipped" in err
    lines = text.splitlines()
    assert lines[0] == "warning: skipped bad trace events: " + b0["message"]
    assert lines[1] == "warning: skipped bad trace events: " + b1["message"]
    assert "PARTIAL RESULT:" in lines and "  - 7 bad events skipped (the warnings at the top)" in lines
    assert sum(line.count(" complete events as bad ") for line in lines) == 2  # not repeated under PARTIAL RESULT


def test_a_trace_with_only_bad_events_is_an_error_naming_the_file(dirs, capsys):
    _, d = dirs
    events = [dict(e, ts=str(e["ts"])) if e["ph"] == "X" else e for e in cpu_rank(1)]  # every ts a string
    write_trace(d / "rank1.1.pt.trace.json", 1, 2, events, kineto_style=False)  # compact: the slow path
    code, out, err = _run(capsys, d)
    assert code == 2 and not out
    assert err.startswith(f"meshkit analyze: error: analyze: the trace of rank 1, `{d / 'rank1.1.pt.trace.json'}`, "
                          "has no usable events: rank1.1.pt.trace.json: skipped 9 of 9 complete events as bad "
                          "(9 ts not a number); first: ts not a number: ")
    assert "dur >= 0; fix the program that wrote this file" in err


def test_an_integer_too_large_for_a_double_is_not_finite(tmp_path):
    """JSON allows any integer; one with 400 digits is skipped as not finite, not a crash of the analysis."""
    ev = cpu_rank(0)
    huge = X("aten::mm", "cpu_op", 75, 10 ** 400, 1)
    write_trace(tmp_path / "rank0.1.pt.trace.json", 0, 1, ev[:3] + [huge] + ev[3:])
    sink, _, _ = load_trace(str(tmp_path / "rank0.1.pt.trace.json"))
    assert sink.bad == {"dur not finite": 1} and sink.complete == len([e for e in ev if e.get("ph") == "X"])


@pytest.mark.parametrize("bad", ["42", 10 ** 400, True], ids=["string", "huge", "bool"])
@pytest.mark.parametrize("index,cat", [(1, "cuda_runtime"), (7, "kernel")])
def test_a_correlation_that_is_not_a_number_is_skipped(tmp_path, bad, index, cat):
    """In Kineto's layout (the typed path) as in plain JSON: the launch or kernel is skipped and counted,
    the rest is read as it is (it was a crash of the analysis: ValueError / OverflowError)."""
    clean, events = cuda_rank(0), cuda_rank(0)
    assert events[index]["cat"] == cat
    events[index] = dict(events[index], args=dict(events[index]["args"], correlation=bad))
    for style in (True, False):
        d = tmp_path / f"{style}"
        d.mkdir()
        write_trace(d / "rank0.1.pt.trace.json", 0, 1, events, kineto_style=style)
        sink, _, _ = load_trace(str(d / "rank0.1.pt.trace.json"))
        assert sink.bad == {"correlation not a number": 1} and sink.complete == len(clean) - 1, style
        write_trace(d / "rank0.1.pt.trace.json", 0, 1, [e for i, e in enumerate(clean) if i != index])
        want = analyze_rank0(d)
        write_trace(d / "rank0.1.pt.trace.json", 0, 1, events, kineto_style=style)
        got = analyze_rank0(d)
        assert {k: v for k, v in got.items() if k not in ("partial", "bad_events")} == \
            {k: v for k, v in want.items() if k not in ("partial", "bad_events")}
        assert got["bad_events"] == 1


def analyze_rank0(d):
    from meshkit.profiling.overlap import analyze

    return analyze(str(d))["ranks"]["0"]


def test_a_step_on_a_thread_id_too_large_for_a_double_is_read(tmp_path):
    """A thread id is not a measurement: one that no double holds is no thread's, not a crash."""
    ev = cpu_rank(0)
    ev[0] = dict(ev[0], tid=10 ** 400)  # ProfilerStep#1
    write_trace(tmp_path / "rank0.1.pt.trace.json", 0, 1, ev)
    from meshkit.profiling.overlap import analyze

    assert analyze(str(tmp_path))["ranks"]["0"]["steps"] == 2


def test_any_field_of_any_type_never_crashes_the_analysis(tmp_path):
    """Random fields of the unit traces set to values of every JSON type (huge integers, null, strings,
    lists, objects, bools) in both layouts: the analysis reads, skips or refuses (TraceLoadError), and
    never raises anything else. (It found five crashes: a string or huge correlation, a huge ts / dur /
    thread id.)"""
    import random

    from meshkit.profiling.overlap import analyze
    from meshkit.profiling.trace import TraceLoadError

    rng = random.Random(0)
    values = ["abc", "12", 10 ** 400, -10 ** 400, None, [], {}, True, 1.5, -3, 0, 2 ** 63, "", {"x": 1}]
    fields = ["ph", "cat", "name", "ts", "dur", "tid", "args", "args.correlation", "args.stream"]
    for i in range(120):
        events = [dict(e, args=dict(e.get("args", {}))) for e in rng.choice((cuda_rank, cpu_rank))(0)]
        for _ in range(rng.randint(1, 3)):
            ev, key, value = rng.choice(events), rng.choice(fields), rng.choice(values)
            if not key.startswith("args."):
                ev[key] = value
            elif isinstance(ev.get("args"), dict):
                ev["args"][key[5:]] = value
        d = tmp_path / str(i)
        d.mkdir()
        write_trace(d / "rank0.1.pt.trace.json", 0, 1, events, kineto_style=rng.random() < 0.7)
        try:
            analyze(str(d))
        except TraceLoadError:
            pass
