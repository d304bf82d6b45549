"""The console filters meshkit applies to library noise it causes, each on the real source of the noise.

- kineto's ``USDT ... profiler_start/stop`` lines (meshkit.profiling.window.kineto_lines_filtered): gone, while
  anything else written to fd 2 meanwhile is kept, in a fresh interpreter (the lines go to the process's fd 2).
"""

from __future__ import annotations

import subprocess
import sys

PROFILE = r"""
import os, torch
from meshkit.profiling.window import kineto_lines_filtered
filtered = {filtered}
p = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
ctx = kineto_lines_filtered if filtered else __import__("contextlib").nullcontext
with ctx():
    p.start()
    torch.ones(3).sum()
    os.write(2, b"a line someone else wrote\n")
with ctx():
    p.stop()
"""


def _stderr(filtered: bool) -> str:
    proc = subprocess.run([sys.executable, "-c", PROFILE.format(filtered=filtered)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stderr


def test_kineto_usdt_lines_filtered_and_other_lines_kept():
    raw = _stderr(False)
    assert "profiler_start" in raw and "profiler_stop" in raw  # what torch's kineto prints unfiltered
    quiet = _stderr(True)
    assert "USDT" not in quiet and "a line someone else wrote" in quiet, quiet


def test_lightning_leafspec_warning_hidden_only_where_lightning_raises_it():
    """Lightning 2.6's pytree helper builds torch's deprecated LeafSpec for every batch; NDParallelStrategy hides
    that FutureWarning from that module only."""
    import warnings

    from lightning.pytorch.utilities._pytree import _tree_flatten
    from torch.utils._pytree import LeafSpec

    import meshkit

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _tree_flatten(3)  # a leaf: Lightning builds LeafSpec()
        assert any("LeafSpec" in str(w.message) for w in seen)  # what every rank printed
        seen.clear()
        meshkit.NDParallelStrategy("fsdp2")
        _tree_flatten(3)
        assert not [w for w in seen if "LeafSpec" in str(w.message)]
        LeafSpec()  # a user's own use still warns
        assert [w for w in seen if "LeafSpec" in str(w.message)]


RANK = r"""
import os, sys
from meshkit.plugins.console import report_once
os.environ["RANK"] = sys.argv[1]
try:
    raise ValueError(sys.argv[3])
except ValueError as exc:
    report_once(exc, job=sys.argv[2])
    raise
"""


def test_a_config_error_every_rank_raises_is_printed_once(tmp_path):
    """4 ranks of one job raise the same error: one traceback, three one-line notes; every exit status stays 1.
    Another message, or another job, is printed in full again."""
    import uuid

    job = f"127.0.0.1:{uuid.uuid4()}"

    def rank(r: int, message: str, job: str = job) -> str:
        proc = subprocess.run([sys.executable, "-c", RANK, str(r), job, message], capture_output=True, text=True,
                              timeout=60)
        assert proc.returncode == 1, proc.stderr
        return proc.stderr

    out = [rank(r, "`tp=3` does not divide the 4 devices") for r in range(4)]
    assert ["Traceback" in o for o in out] == [True, False, False, False], out
    assert all(o.strip() == "rank {}: ValueError (the same error another rank of this job printed in full): "
               "`tp=3` does not divide the 4 devices".format(r) for r, o in enumerate(out) if r), out
    assert "Traceback" in rank(1, "another message")
    assert "Traceback" in rank(2, "`tp=3` does not divide the 4 devices", job=job + "-next")
