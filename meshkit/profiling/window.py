"""Profiler windows: when a ``torch.profiler`` window runs, what it costs, and what its trace says.

:class:`ProfilerWindows` owns the window logic that ``MFUMonitor`` drives from its hooks: start
and stop the profiler (1 warm-up + ``steps`` active batches), write meshkit's phase markers into
the trace (``meshkit:forward_backward``, ``meshkit:optimizer``, ``meshkit:validation``,
``meshkit:checkpoint``: the spans :mod:`meshkit.profiling.overlap`'s step model reads), export the
trace to ``rank{R}.{first_batch}.pt.trace.json``, parse it **once** into per-step buckets, and
space the windows so that their measured cost, all windows together, stays within a budget of the
training time.

Example::

    >>> w = ProfilerWindows("/tmp/prof", rank=0, every=100, start=5, steps=2, budget=0.005)
    >>> w.due(batch=5), w.due(batch=4)
    (True, False)
    >>> w.first = 5                          # (set by start(5))
    >>> w.schedule(cost_s=0.5, step_s=0.1)   # this window and the next: 1 s, 0.5 % of 2000 batches of 0.1 s
    >>> w.next_batch
    2000
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

import numpy as np

from meshkit.profiling.overlap import step_buckets, step_claims
from meshkit.profiling.trace import PHASE_MARKERS, RankTrace, load_rank_trace

__all__ = ["ProfilerWindows", "WindowSteps", "kineto_lines_filtered"]

_KINETO_USDT = re.compile(r"^USDT:[^\n]*SyncActivityProfilerHandler\.cpp:\d+\] profiler_(?:start|stop)\s*$")
"""Known harmless: libkineto (torch 2.13) writes ``USDT:<date> <pid>:<tid> SyncActivityProfilerHandler.cpp:52]
profiler_start`` (and ``profiler_stop``) to the process's stderr at every profiler start and stop, at a log level above
ERROR, so ``KINETO_LOG_LEVEL`` cannot hide them without hiding kineto's errors too; on 4 ranks they were 8 lines
breaking Lightning's progress bar in every profiled run."""


@contextlib.contextmanager
def kineto_lines_filtered() -> Iterator[None]:
    """Run a profiler start/step/stop with the process's stderr (fd 2) caught, then write back every line but
    kineto's :data:`_KINETO_USDT` start/stop markers (anything else kineto or another thread wrote is kept).

    >>> with kineto_lines_filtered():
    ...     pass
    """
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):  # no real fd 2 (an embedding host): nothing to filter
        yield
        return
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 2)
        try:
            yield
        finally:
            try:
                sys.stderr.flush()
            finally:
                os.dup2(saved, 2)
                os.close(saved)
            caught.seek(0)
            kept = [line for line in caught.read().decode(errors="replace").splitlines(keepends=True)
                    if not _KINETO_USDT.match(line)]
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()


@dataclass
class WindowSteps:
    """What one window's trace says about its active batches (ms per batch, by trace bucket)."""

    first: int
    """The window's first batch (its warm-up batch)."""
    batches: list[int]
    """The active batches, in order."""
    buckets_ms: list[dict[str, float]]
    """Per active batch: :data:`meshkit.profiling.overlap.TRACE_BUCKETS` in ms, and ``stop_signal`` (the part of
    ``exposed_comm`` spent in Lightning's stop-signal broadcast between batches) where the trace marks it."""
    trace: RankTrace | None = None
    claims: list = field(default_factory=list)

    def mean(self, name: str) -> float:
        return float(np.mean([b[name] for b in self.buckets_ms])) if self.buckets_ms else 0.0


class ProfilerWindows:
    """Start, mark, stop, parse and schedule ``torch.profiler`` windows for one rank.

    Args:
        trace_dir: where traces go.
        rank: this process's global rank (in the file name).
        every: a window at most every this many batches (0: never).
        start: the first window's batch.
        steps: active batches per window (after one warm-up batch).
        budget: the largest share of training time windows may take (``None``: no limit).
        cuda: also record CUDA activity.
        metadata: top-level keys written into every trace (JSON-serialisable values), e.g. the peak
            FLOP/s that ``meshkit analyze`` then reports.
    """

    def __init__(self, trace_dir: str, rank: int, every: int, start: int, steps: int,
                 budget: float | None, cuda: bool = False, metadata: dict[str, Any] | None = None) -> None:
        self.trace_dir, self.rank, self.every, self.steps = trace_dir, rank, every, steps
        self.budget, self.cuda, self.metadata = budget, cuda, dict(metadata or {})
        self.next_batch = start
        self.first = -1
        self.history: list[dict[str, float]] = []
        """Per finished window: batch, cost_s, step_s, next_batch."""
        self.spent_s = 0.0
        """What every finished window cost, together (s)."""
        self._prof: Any = None
        self._seen = 0
        self._t0 = 0.0
        self._open: dict[str, Any] = {}

    # ---------------------------------------------------------------- lifecycle

    @property
    def active(self) -> bool:
        return self._prof is not None

    def due(self, batch: int) -> bool:
        return bool(self.every) and batch >= self.next_batch and not self.active

    def start(self, batch: int) -> None:
        """Start a window at ``batch`` (its warm-up batch)."""
        from torch.profiler import ProfilerActivity, profile, schedule

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        os.makedirs(self.trace_dir, exist_ok=True)
        self._t0 = time.perf_counter()
        self.first, self._seen = batch, 0
        self._prof = profile(activities=activities, schedule=schedule(wait=0, warmup=1, active=self.steps, repeat=1),
                             on_trace_ready=lambda p: p.export_chrome_trace(self.path(self.first)),
                             record_shapes=False, with_stack=False)
        with kineto_lines_filtered():
            self._prof.start()
        for key, value in self.metadata.items():
            self._prof.add_metadata_json(key, json.dumps(value))

    def step(self) -> bool:
        """The end of a batch inside the window; True when the window's last batch has ended."""
        with kineto_lines_filtered():  # the schedule starts and stops kineto inside step()
            self._prof.step()
        self._seen += 1
        return self._seen >= 1 + self.steps

    def stop(self) -> WindowSteps | None:
        """Stop the profiler (exporting the trace), parse this rank's trace once, and return its batches."""
        self.mark_end_all()
        with kineto_lines_filtered():
            self._prof.stop()
        self._prof = None
        path = self.path(self.first)
        if not os.path.exists(path):
            return None
        rt = load_rank_trace(path, self.rank)
        if rt.step_windows.shape[0] == 0:
            return None
        claims = step_claims(rt)
        b = step_buckets(rt, claims)
        n = rt.step_windows.shape[0]
        # ProfilerStep#k spans the k-th prof.step() to the next: batch first + k (k = 1 .. steps).
        batches = [self.first + int(k) for k in rt.step_ids]
        per = [{name: float(v[i]) / 1e3 for name, v in b.items()} for i in range(n)]
        stop = rt.phases.get("stop_signal")
        if stop is not None and len(stop):  # the step's exposed comm outside it: the stop-signal wait (the timers')
            waited = dict(claims)["exposed_comm"].intersect(stop).measure(rt.step_windows[:, 0], rt.step_windows[:, 1])
            for i in range(n):
                per[i]["stop_signal"] = float(waited[i]) / 1e3
        return WindowSteps(self.first, batches, per, rt, claims)

    def discard(self) -> None:
        """Stop an unfinished window (e.g. the run ended inside it) and delete its trace."""
        if self._prof is None:
            return
        self.mark_end_all()
        with kineto_lines_filtered():
            self._prof.stop()
        self._prof = None
        if os.path.exists(self.path(self.first)):
            os.remove(self.path(self.first))

    def path(self, first: int, rank: int | None = None) -> str:
        return os.path.join(self.trace_dir, f"rank{self.rank if rank is None else rank}.{first}.pt.trace.json")

    # ---------------------------------------------------------------- markers

    def mark_begin(self, phase: str) -> None:
        """Open ``meshkit:<phase>`` in the trace (only while a window records); the span names are those
        the trace reader knows (:data:`meshkit.profiling.trace.PHASE_MARKERS`), so writer and reader agree."""
        name = f"meshkit:{phase}"
        if PHASE_MARKERS.get(name) != phase:
            known = [v for k, v in PHASE_MARKERS.items() if k.startswith("meshkit:")]
            raise ValueError(f"ProfilerWindows.mark_begin: `phase={phase!r}` is not a phase the trace reader knows; "
                             f"use one of {known} (meshkit.profiling.trace.PHASE_MARKERS).")
        if self._prof is None or phase in self._open:
            return
        from torch.autograd.profiler import record_function

        rf = record_function(name)
        rf.__enter__()
        self._open[phase] = rf

    def mark_end(self, phase: str) -> None:
        rf = self._open.pop(phase, None)
        if rf is not None:
            rf.__exit__(None, None, None)

    def mark_end_all(self) -> None:
        for phase in list(self._open):
            self.mark_end(phase)

    # ---------------------------------------------------------------- cost and spacing

    def cost_s(self, step_s: float) -> float:
        """This window's cost so far: wall time since its start minus its batches at ``step_s`` each."""
        return max(time.perf_counter() - self._t0 - (1 + self.steps) * step_s, 0.0)

    def schedule(self, cost_s: float, step_s: float) -> None:
        """Record the finished window (cost agreed across ranks) and set the next one's batch: ``every``
        batches on, or later, so that all windows together, the next one included, stay within ``budget`` of
        the training time at its end (``spent_s ≤ budget · batches · step_s``; only the first window, at
        ``start``, comes before any budget has accrued)."""
        self.spent_s += cost_s
        self.next_batch = self.first + self.every
        if self.budget is not None and step_s > 0:
            # the next window is paid for when it starts: it will cost about what the last one did
            self.next_batch = max(self.next_batch, math.ceil((self.spent_s + cost_s) / (self.budget * step_s)))
        self.history.append({"batch": self.first, "cost_s": cost_s, "step_s": step_s, "next_batch": self.next_batch})
