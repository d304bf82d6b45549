"""End to end: every script in examples/ runs as a user would run it, at its ``--tiny`` size.

Each runs in a fresh process (as ``python examples/<name>.py --tiny``) with a wall-clock timeout, in a
temporary working directory, without the test suite's ``TRITON_INTERPRET=1``; the checks read what the
script prints.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TIMEOUT_S = 600  # measured 1.5-2 min each on 2 busy cores


def _run(script: str, *args: str, cwd: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    env.setdefault("OMP_NUM_THREADS", "1")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", script), "--tiny", *args], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{script} exited {proc.returncode}:\n{out[-4000:]}"
    return out


@pytest.mark.timeout(TIMEOUT_S + 60)
def test_hsdp_tp_transformers_trains_saves_and_resumes(tmp_path):
    out = _run("hsdp_tp_transformers.py", "--root", str(tmp_path / "run"), cwd=str(tmp_path))
    assert "dp_shard=2" in out and "tp=2" in out, out[-2000:]
    # 2 steps an epoch: epoch 0, checkpoint, then the resumed Trainer trains epoch 1 from step 2.
    assert re.search(r"trained 2 steps, saved .*checkpoint, resumed to step 4", out), out[-2000:]
    assert os.path.isdir(tmp_path / "run" / "checkpoint")


@pytest.mark.timeout(TIMEOUT_S + 60)
def test_mfu_breakdown_shows_the_slow_loader_as_data_wait(tmp_path):
    # 0.2 s of sleep per batch against a tiny model's ~50 ms step: data wait dominates even on a busy machine.
    out = _run("mfu_breakdown.py", "--sleep", "0.2", "--logdir", str(tmp_path / "logs"), cwd=str(tmp_path))
    match = re.search(r"data_wait was ([\d.]+)% of the step time", out)
    assert match, out[-2000:]
    assert float(match.group(1)) >= 30.0, out[-2000:]
    assert "tab TIME SERIES" in out and "MFU_breakdown_pct/data_wait" in out and "MFU/breakdown_waterfall" in out


@pytest.mark.timeout(TIMEOUT_S + 60)
def test_occupancy_my_kernel_from_python_and_cli(tmp_path):
    out = _run("occupancy_my_kernel.py", cwd=str(tmp_path))
    for arch in ("sm_80", "sm_90"):
        assert re.search(rf"^{arch}\s+1024\s+4\s+\d+", out, re.M), out[-2000:]  # the Python table
        assert re.search(rf"row_softmax\s+{arch}\s+4\s+3\s+\d+", out), out[-2000:]  # the CLI table
