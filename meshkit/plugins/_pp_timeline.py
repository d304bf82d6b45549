"""The pipeline timeline record: one JSON object per stage action, one JSON Lines file per rank.

Contract (shared with ``meshkit.profiling``, which reads the files without importing plugins/):

- file ``<directory>/pp_timeline_rank{R}.jsonl``, R = the global rank; truncated when a recorder
  opens it, then one line appended per action, flushed at the end of each step;
- each line ``{"step": int, "rank": int, "stage": int, "microbatch": int, "action": str,
  "start_ns": int, "end_ns": int}``;
- ``action``: "F" forward, "B" full backward (input and weight gradients), "I" input-gradient
  backward, "W" weight-gradient backward (the last two from zero-bubble schedules);
- ``step``: 0-based count of training steps run through this pipeline (forward-only evaluation is
  not recorded); ``start_ns``/``end_ns``: ``time.perf_counter_ns()`` around the stage's compute, which
  excludes waiting for peers' activations or gradients. The clock is monotonic and system-wide on
  Linux, so ranks on one host share it; across hosts compare durations and gaps, not start times.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

TIMELINE_FILE = "pp_timeline_rank{rank}.jsonl"
TIMELINE_FIELDS = ("step", "rank", "stage", "microbatch", "action", "start_ns", "end_ns")


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
        self._events: list[dict[str, Any]] = []

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
                {"step": self.step, "rank": self.rank, "stage": stage.stage_index, "microbatch": int(mb),
                 "action": action, "start_ns": start, "end_ns": time.perf_counter_ns()}
            )
        return out

    def end_step(self) -> None:
        """Append this step's actions to the file and move to the next step."""
        with self.path.open("a") as f:
            for e in self._events:
                f.write(json.dumps(e) + "\n")
        self._events.clear()
        self.step += 1


def read_timeline(directory: str | os.PathLike) -> list[dict[str, Any]]:
    """Every action recorded under ``directory``, all ranks, sorted by (rank, start_ns)."""
    events = []
    for path in sorted(Path(directory).glob(TIMELINE_FILE.format(rank="*"))):
        events += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return sorted(events, key=lambda e: (e["rank"], e["start_ns"]))
