"""Ground floor: the pipeline timeline contract, one JSON object per stage action, one JSON Lines file per rank.

Written by ``meshkit.plugins.pipeline`` (:class:`TimelineRecorder`), read by ``meshkit.profiling``
(:func:`read_timeline`); this module imports neither.

- file ``<directory>/pp_timeline_rank{R}.jsonl`` (:data:`TIMELINE_FILE`), R = the global rank;
  truncated when a recorder opens it, then one line appended per action, flushed at the end of each
  step; a run's directory is ``<log_dir>/pp_timeline/``;
- each line ``{"step": int, "rank": int, "stage": int, "microbatch": int, "action": str,
  "start_ns": int, "end_ns": int}`` (:data:`TIMELINE_FIELDS`, read back as :class:`TimelineRecord`);
- ``action`` (:data:`ACTIONS`): "F" forward, "B" full backward (input and weight gradients), "I"
  input-gradient backward, "W" weight-gradient backward (the last two from zero-bubble schedules);
- ``stage``: the (virtual) stage index, ``chunk · pp + pp_rank`` for looped multi-stage schedules;
- ``step``: 0-based count of training steps run through this pipeline (forward-only evaluation is
  not recorded); ``start_ns``/``end_ns``: ``time.perf_counter_ns()`` around the stage's compute, which
  excludes waiting for peers' activations or gradients. The clock is monotonic and system-wide on
  Linux, so ranks on one host share it; across hosts compare durations and gaps, not start times.

>>> import json, os, tempfile
>>> d = tempfile.mkdtemp()
>>> rec = dict(step=0, rank=0, stage=0, microbatch=0, action="F", start_ns=0, end_ns=5)
>>> _ = open(os.path.join(d, "pp_timeline_rank0.jsonl"), "w").write(json.dumps(rec) + "\\n")
>>> read_timeline(d)[0].duration_ns
5
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

__all__ = [
    "TIMELINE_FILE",
    "TIMELINE_FIELDS",
    "ACTIONS",
    "TimelineRecord",
    "TimelineRecorder",
    "read_timeline",
    "find_timeline_dir",
]

TIMELINE_FILE = "pp_timeline_rank{rank}.jsonl"
ACTIONS = ("F", "B", "I", "W")
_FILE_RE = re.compile(r"^pp_timeline_rank(\d+)\.jsonl$")


@dataclass(frozen=True)
class TimelineRecord:
    """One executed pipeline action, as :class:`TimelineRecorder` writes it (one JSON object per line)."""

    step: int
    rank: int
    stage: int
    microbatch: int
    action: str
    """``"F"``, ``"B"``, ``"I"`` or ``"W"``."""
    start_ns: int
    end_ns: int
    """``time.perf_counter_ns()`` at the start and end of the action."""

    @property
    def duration_ns(self) -> int:
        return self.end_ns - self.start_ns


TIMELINE_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(TimelineRecord))
_TYPES = {f.name: (str if f.name == "action" else int) for f in fields(TimelineRecord)}


class TimelineRecorder:
    """Records every F/B/I/W action of the stages it is attached to; see the module docstring.

    >>> import tempfile
    >>> rec = TimelineRecorder(tempfile.mkdtemp(), rank=0)
    >>> rec.path.name
    'pp_timeline_rank0.jsonl'
    """

    def __init__(self, directory: str | os.PathLike, rank: int) -> None:
        self.rank = rank
        self.path = Path(directory) / TIMELINE_FILE.format(rank=rank)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text("")
        self.step = 0
        self.enabled = True
        self._events: list[TimelineRecord] = []

    def attach(self, stage: Any) -> None:
        """Wrap ``stage``'s forward_one_chunk / backward_one_chunk / backward_weight_one_chunk."""
        fwd, bwd, bwd_w = stage.forward_one_chunk, stage.backward_one_chunk, stage.backward_weight_one_chunk

        def forward_one_chunk(fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
            return self._timed(stage, fwd_chunk_id, "F", fwd, fwd_chunk_id, *args, **kwargs)

        def backward_one_chunk(bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
            full = kwargs.get("full_backward", args[1] if len(args) > 1 else True)
            return self._timed(stage, bwd_chunk_id, "B" if full else "I", bwd, bwd_chunk_id, *args, **kwargs)

        def backward_weight_one_chunk(bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
            return self._timed(stage, bwd_chunk_id, "W", bwd_w, bwd_chunk_id, *args, **kwargs)

        stage.forward_one_chunk = forward_one_chunk
        stage.backward_one_chunk = backward_one_chunk
        stage.backward_weight_one_chunk = backward_weight_one_chunk

    def _timed(self, stage: Any, mb: int, action: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        # A backward on a stage without backward (forward-only evaluation) is a no-op: not an action.
        record = self.enabled and (action == "F" or stage.has_backward)
        start = time.perf_counter_ns()
        out = fn(*args, **kwargs)
        if record:
            self._events.append(
                TimelineRecord(self.step, self.rank, stage.stage_index, int(mb), action, start, time.perf_counter_ns())
            )
        return out

    def end_step(self) -> None:
        """Append this step's actions to the file and move to the next step."""
        with self.path.open("a") as f:
            for e in self._events:
                f.write(json.dumps(asdict(e)) + "\n")
        self._events.clear()
        self.step += 1


def find_timeline_dir(logdir: str | os.PathLike) -> str | None:
    """The directory holding ``pp_timeline_rank*.jsonl`` under ``logdir`` (itself or a ``pp_timeline/``), or None."""
    for root, _, files in os.walk(logdir):
        if any(_FILE_RE.match(f) for f in files):
            return root
    return None


def _parse(fpath: str, i: int, line: str, last: bool) -> TimelineRecord | None:
    """One line as a record; None for a blank line or a last line cut off mid-write."""
    if not line.strip():
        return None
    try:
        obj = json.loads(line)
    except ValueError:
        if last:
            return None
        raise ValueError(f"read_timeline: {fpath}:{i + 1} is not valid JSON: {line[:80]!r}.") from None
    values = {}
    for key, typ in _TYPES.items():
        val = obj.get(key) if isinstance(obj, dict) else None
        if not isinstance(val, typ) or isinstance(val, bool):
            raise ValueError(f"read_timeline: {fpath}:{i + 1}: field `{key}={val!r}` must be {typ.__name__}.")
        values[key] = val
    if values["action"] not in ACTIONS:
        raise ValueError(f"read_timeline: {fpath}:{i + 1}: `action={values['action']!r}` must be F, B, I or W.")
    if values["end_ns"] < values["start_ns"]:
        raise ValueError(f"read_timeline: {fpath}:{i + 1}: `end_ns={values['end_ns']}` < `start_ns={values['start_ns']}`.")
    return TimelineRecord(**values)


def read_timeline(path: str | os.PathLike) -> list[TimelineRecord]:
    """Every action in ``path`` (a directory of ``pp_timeline_rank{R}.jsonl`` files, or one file),
    sorted by (rank, start_ns).

    A last line cut off mid-write (no trailing newline, invalid JSON) is dropped; any other
    malformed line raises ``ValueError`` naming the file, line and field.
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        files = sorted(os.path.join(path, f) for f in os.listdir(path) if _FILE_RE.match(f))
    elif os.path.isfile(path):
        files = [path]
    else:
        raise ValueError(f"read_timeline: `path={path!r}` does not exist; pass the run's <log_dir>/pp_timeline.")
    if not files:
        raise ValueError(f"read_timeline: no pp_timeline_rank*.jsonl files in `path={path!r}`.")
    records: list[TimelineRecord] = []
    for fpath in files:
        with open(fpath, encoding="utf-8") as f:
            lines = f.read().split("\n")
        for i, line in enumerate(lines):
            rec = _parse(fpath, i, line, last=i == len(lines) - 1)
            if rec is not None:
                records.append(rec)
    return sorted(records, key=lambda r: (r.rank, r.start_ns))
