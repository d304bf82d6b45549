"""The fork server of tests/distributed/jobs.py keeps subprocess.Popen's contract for a forked rank: a real pid in
its own session, the exit code (a signal's as its negative), the environment, folder, argv and output of a
``python -m`` start. A server that preloads only a stand-in worker (tests/fixtures/fork_probe.py), so no torch."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.distributed import jobs

PROBE = "tests.fixtures.fork_probe"


@pytest.fixture(scope="module")
def server():
    s = jobs.ForkServer(preload=(PROBE,))
    yield s
    s.close()


def _spawn(server, log: Path, *args: str, **env: str) -> jobs.Rank:
    return server.spawn(PROBE, args, {**jobs._env(), **env}, log)


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().split()[2]


def test_a_forked_rank_starts_as_python_m_would(server, tmp_path):
    env = {**jobs._env(), "RANK": "3"}
    rank = server.spawn(PROBE, ["env", "a b"], env, tmp_path / "rank3.log", cwd=tmp_path)
    assert rank.wait(30) == 0 and rank.poll() == 0 and rank.returncode == 0, (tmp_path / "rank3.log").read_text()
    seen = json.loads((tmp_path / "rank3.log").read_text())
    assert seen["argv"] == [str(jobs.ROOT / "tests" / "fixtures" / "fork_probe.py"), "env", "a b"]
    assert seen["main_spec"] == PROBE  # Lightning's launcher starts the other ranks with `-m` of this
    assert seen["env"] == env and seen["cwd"] == seen["path0"] == str(tmp_path)
    assert seen["session_leader"] and seen["stdin"] == "" and seen["threads"] == 1


def test_exit_codes_are_popens(server, tmp_path):
    three, raised = _spawn(server, tmp_path / "a.log", "exit", "3"), _spawn(server, tmp_path / "b.log", "raise")
    assert jobs.wait([three, raised], 30) == [3, 1]
    assert "ValueError: probe" in (tmp_path / "b.log").read_text()


def test_sigkill_of_a_rank_s_group_kills_that_rank_only(server, tmp_path):
    a, b = _spawn(server, tmp_path / "a.log", "sleep"), _spawn(server, tmp_path / "b.log", "sleep")
    assert a.poll() is None and jobs.alive(a.pid) and os.getpgid(a.pid) == a.pid
    with pytest.raises(subprocess.TimeoutExpired):
        a.wait(0.3)
    os.killpg(a.pid, signal.SIGKILL)
    assert a.wait(10) == -signal.SIGKILL and not jobs.alive(a.pid)
    assert b.poll() is None and jobs.alive(b.pid)
    jobs.kill([b])
    assert b.returncode == -signal.SIGKILL


def test_a_stopped_rank_is_alive_until_killed(server, tmp_path):
    rank = _spawn(server, tmp_path / "a.log", "stop")
    deadline = time.monotonic() + 30
    while _state(rank.pid) != "T" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _state(rank.pid) == "T" and "stopped" in (tmp_path / "a.log").read_text()
    time.sleep(0.3)  # several of the server's reaping rounds
    assert rank.poll() is None and jobs.alive(rank.pid)
    jobs.kill([rank])
    assert rank.returncode == -signal.SIGKILL


def test_a_server_with_a_thread_refuses_to_fork(tmp_path, monkeypatch):
    monkeypatch.setenv("FORK_PROBE_THREAD", "1")
    s = jobs.ForkServer(preload=(PROBE,))
    try:
        with pytest.raises(RuntimeError, match="the fork server has 2 threads; a forked rank would inherit"):
            _spawn(s, tmp_path / "a.log", "exit", "0")
    finally:
        s.close()
