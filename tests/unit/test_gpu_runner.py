"""The GPU run's driver (benchmarks/gpu/run_all.py) fails soft: a hang, a crash or a missing result
is recorded in the section's record and the run goes on. No GPU and no torch work needed."""

from __future__ import annotations

import importlib.util
import os
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def run_all():
    path = os.path.join(ROOT, "benchmarks", "gpu", "run_all.py")
    spec = importlib.util.spec_from_file_location("meshkit_gpu_run_all", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _fake(monkeypatch, run_all, code: str):
    monkeypatch.setattr(run_all, "_command", lambda name, out, cpu: [sys.executable, "-c", code, out])


def test_hang_is_a_timeout_with_its_children_killed(run_all, monkeypatch, tmp_path):
    # the child starts a grandchild that keeps stdout open: the section must still end at its limit
    _fake(monkeypatch, run_all, "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', "
          "'import time; time.sleep(60)']); print('started', flush=True); time.sleep(60)")
    t0 = time.perf_counter()
    rec = run_all.run_section("registers", 2, True, str(tmp_path))
    assert time.perf_counter() - t0 < 20
    assert rec["status"] == "timeout" and rec["returncode"] is None and "no exit within 2 s" in rec["error"]
    assert "started" in rec["stdout_tail"] and rec["figures"] is None


def test_crash_and_missing_figures_are_recorded(run_all, monkeypatch, tmp_path):
    _fake(monkeypatch, run_all, "import sys; sys.exit('boom: CUDA out of memory')")
    rec = run_all.run_section("mfu_8b", 30, True, str(tmp_path))
    assert rec["status"] == "failed" and rec["returncode"] == 1 and "boom" in rec["error"]
    _fake(monkeypatch, run_all, "pass")
    rec = run_all.run_section("mfu_8b", 30, True, str(tmp_path))
    assert rec["status"] == "failed" and "wrote no figures" in rec["error"]
    _fake(monkeypatch, run_all, "import json, sys; json.dump({'x': 1}, open(sys.argv[1], 'w'))")
    rec = run_all.run_section("mfu_8b", 30, True, str(tmp_path))
    assert rec["status"] == "ok" and rec["figures"] == {"x": 1}


def test_junit_counts(run_all, tmp_path):
    xml = tmp_path / "r.xml"
    xml.write_text('<testsuites><testsuite><testcase classname="a" name="t1"/>'
                   '<testcase classname="a" name="t2"><failure message="assert 1 == 2"/></testcase>'
                   '<testcase classname="a" name="t3"><skipped message="needs CUDA"/></testcase>'
                   '<testcase classname="a" name="t4"><error message="fixture"/></testcase></testsuite></testsuites>')
    got = run_all._junit(str(xml))
    assert {k: got[k] for k in ("passed", "failed", "skipped", "errors")} == {"passed": 1, "failed": 1, "skipped": 1,
                                                                                "errors": 1}
    assert got["failures"][0] == {"test": "a::t2", "message": "assert 1 == 2"}
