"""End to end: every script in examples/ runs as a user would run it, at its ``--tiny`` size (README's
``python examples/X.py`` commands, see tests/e2e/test_readme.py; README's ``meshkit consolidate`` runs after the
hsdp_tp example, on the checkpoint it saved).

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

from tests.e2e import test_console
from tests.e2e import test_readme as readme

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


@pytest.mark.timeout(TIMEOUT_S + 120)
def test_hsdp_tp_transformers_trains_saves_and_resumes(tmp_path):
    out = _run("hsdp_tp_transformers.py", cwd=str(tmp_path))  # its default --root: ./hsdp_tp_logs
    assert "dp_shard=2" in out and "tp=2" in out, out[-2000:]
    # 2 steps an epoch: epoch 0, checkpoint, then the resumed Trainer trains epoch 1 from step 2.
    assert re.search(r"trained 2 steps, saved .*checkpoint, resumed to step 4, loss [\d.]+ at the first step -> "
                     r"[\d.]+ at the last", out), out[-2000:]
    assert os.path.isdir(tmp_path / "hsdp_tp_logs" / "checkpoint")
    # a quiet console (issue 26), by the console test's definition of a warning line
    assert not [ln for ln in out.splitlines() if test_console.WARNING_LINE.search(ln)], out[-4000:]
    # README's export command, as written, in the folder the example ran in
    (consolidate,) = readme.commands("after_hsdp_tp_example")
    readme.run_as_written(consolidate, str(tmp_path), timeout=300)
    assert (tmp_path / "model.pt").is_file() and (tmp_path / "model.pt.meshkit.json").is_file()


@pytest.mark.timeout(TIMEOUT_S + 60)
@pytest.mark.parametrize("preset,layout", [("hsdp_tp", ("dp_shard=2", "tp=2")), ("hsdp_cp", ("dp_shard=1", "cp=4"))])
def test_fabric_hsdp_tp_trains_saves_loads_and_measures(tmp_path, preset, layout):
    out = _run("fabric_hsdp_tp.py", "--root", str(tmp_path / "run"), "--preset", preset, cwd=str(tmp_path))
    assert all(axis in out for axis in layout), out[-2000:]
    assert re.search(r"trained 2 steps .*saved .*checkpoint, resumed at step 2, trained to step 4", out), out[-2000:]
    assert re.search(r"MFU \d+\.\d+ % \(measured", out), out[-2000:]  # FabricMFU, against the measured CPU peak
    assert os.path.isfile(tmp_path / "run" / "checkpoint" / "meshkit.json")


@pytest.mark.timeout(TIMEOUT_S + 60)
def test_mfu_breakdown_shows_the_slow_loader_as_data_wait(tmp_path):
    # 0.2 s of sleep per batch against a tiny model's ~50 ms step: data wait dominates even on a busy machine.
    out = _run("mfu_breakdown.py", "--sleep", "0.2", "--logdir", str(tmp_path / "logs"), cwd=str(tmp_path))
    match = re.search(r"data_wait was ([\d.]+)% of the step time", out)
    assert match, out[-2000:]
    assert float(match.group(1)) >= 30.0, out[-2000:]
    assert "tab TIME SERIES" in out and "MFU_breakdown_pct/data_wait" in out and "MFU/breakdown_waterfall" in out
    # a quiet console in a one-device run too: MFUMonitor hides Lightning's own LeafSpec warning (meshkit.quiet)
    assert not [ln for ln in out.splitlines() if test_console.WARNING_LINE.search(ln)], out[-4000:]


@pytest.mark.timeout(TIMEOUT_S + 60)
def test_occupancy_my_kernel_from_python_and_cli(tmp_path):
    out = _run("occupancy_my_kernel.py", cwd=str(tmp_path))
    for arch in ("sm_80", "sm_90"):
        assert re.search(rf"^{arch}\s+1024\s+4\s+\d+", out, re.M), out[-2000:]  # the Python table
        assert re.search(rf"row_softmax\s+{arch}\s+4\s+3\s+\d+", out), out[-2000:]  # the CLI table


@pytest.mark.timeout(TIMEOUT_S + 60)
def test_sequence_parallel_transformers_cuts_the_norms_rows(tmp_path):
    out = _run("sequence_parallel_transformers.py", "--root", str(tmp_path / "run"), cwd=str(tmp_path))
    # 32-token sequences, tp=2: the decoder layers' norms see all 32 rows without SP and 16 with it.
    assert re.search(r"on rank 0: \[32\] without SP, \[16\] with SP; final loss \d", out), out[-2000:]
