"""meshkit.plugins.rendezvous without a Trainer: the rendezvous error's text, a store host that never came,
and the launcher watch in two small real processes. The roll call among real ranks (complete, and with ranks
missing) runs on tests/distributed/test_strategy.py's pool."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest

from meshkit.plugins import rendezvous as R

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("ranks, text", [([0], "rank 0"), ([2, 3], "ranks 2, 3"), ([1, 2, 3], "ranks 1-3"),
                                         ([0, 2, 4, 5, 6, 9], "ranks 0, 2, 4-6, 9")])
def test_ranges(ranks, text):
    assert R.ranges(ranks) == text


def test_the_message_names_the_missing_ranks_the_launch_and_the_fix():
    text = R.rendezvous_failed("node0:29500", 2, 2, timedelta(seconds=10), [2, 3])
    assert text == (
        "NDParallelStrategy: the process-group rendezvous did not complete within `timeout=0:00:10`: ranks 2, 3 of 4 "
        "did not join at node0:29500 (ranks 0, 1 did). `devices=2` × `num_nodes=2` need 4 processes: start `devices` "
        "processes on each of the `num_nodes` nodes (e.g. `torchrun --nnodes 2 --nproc-per-node 2`), with NODE_RANK "
        "set per node, or lower `num_nodes`.")
    cause = R.rendezvous_failed("h:1", 4, 1, None, None, "connection refused", owner="X")
    assert cause.startswith("X: the process-group rendezvous did not complete within `timeout=None`: 4 processes "
                            "were expected at h:1, and not all arrived (connection refused).")


def _rendezvous(port: int, rank: int, world: int, timeout_s: float, out: dict) -> None:
    inits: list[int] = []
    try:
        R.rendezvous(lambda: inits.append(rank), address="127.0.0.1", port=port, rank=rank, devices=world,
                     num_nodes=1, timeout=timedelta(seconds=timeout_s))
        out[rank] = ("ok", inits)
    except RuntimeError as e:
        out[rank] = (str(e), inits)


def test_no_store_host_is_the_rendezvous_error_with_its_cause():
    # rank 1 alone: nothing listens at the address (rank 0, the store's host, never started)
    out: dict = {}
    _rendezvous(_free_port(), 1, 2, 1, out)
    text, inits = out[1]
    assert inits == [] and "2 processes were expected at 127.0.0.1:" in text and "and not all arrived (" in text, text


def test_a_group_from_before_is_reused_only_when_every_rank_holds_it_as_the_launcher_numbers_it():
    assert R.stale_group([R.NO_GROUP] * 4, 4) is None  # none anywhere: start one
    assert R.stale_group(["4:0", "4:1", "4:2", "4:3"], 4) is None  # this job's group on every rank: reuse it
    assert R.stale_group([], 4) is None  # one process: no roll call
    mixed = R.stale_group(["4:0", R.NO_GROUP, "4:2", R.NO_GROUP], 4, owner="X")
    assert mixed.startswith("X: the ranks do not hold the same process group: ranks 0, 2 keep one from before") \
        and "ranks 1, 3 have none (destroyed there, or never started)" in mixed \
        and "Call `torch.distributed.destroy_process_group()` on every rank" in mixed, mixed
    foreign = R.stale_group(["2:0", "2:1", "2:0", "2:1"], 4)
    assert "is not this job's: rank 0: world 2, group rank 0, rank 1: world 2, group rank 1" in foreign, foreign
    assert "rank 0: world 4, group rank 1, rank 1: world 4, group rank 0" in R.stale_group(["4:1", "4:0"], 2)


def test_other_errors_pass_through():
    with pytest.raises(ValueError, match="boom"):
        R.rendezvous(lambda: (_ for _ in ()).throw(ValueError("boom")), address="127.0.0.1", port=1, rank=0,
                     devices=1, num_nodes=1, timeout=timedelta(seconds=1))


def test_is_timeout():
    assert R.is_timeout(RuntimeError("Timed out waiting 20000ms for recv operation to complete"))
    assert R.is_timeout(RuntimeError("wait timeout after 1000ms"))
    assert not R.is_timeout(RuntimeError("connection refused")) and not R.is_timeout(ValueError("timed out"))


_PARENT = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", {child!r}], stderr=open({log!r}, "w"))
open({pid!r}, "w").write(str(child.pid))
time.sleep(120)
"""
_CHILD = """
import time
from meshkit.plugins.rendezvous import exit_with_parent
assert exit_with_parent(3) and exit_with_parent(3)  # one watcher, asked twice
time.sleep(120)
"""


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state == "Z"  # exited; its new parent has not reaped it yet


@pytest.mark.skipif(not Path("/proc/self/exe").exists(), reason="the watch reads /proc (Linux)")
def test_a_rank_exits_when_its_python_launcher_dies(tmp_path):
    pid_file, log = tmp_path / "child.pid", tmp_path / "child.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    parent = subprocess.Popen([sys.executable, "-c", _PARENT.format(child=_CHILD, log=str(log), pid=str(pid_file))],
                              env=env)
    child = None
    try:
        deadline = time.monotonic() + 60
        while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
            time.sleep(0.05)
        child = int(pid_file.read_text())
        time.sleep(1.5)  # the child has imported meshkit and started its watcher
        assert not _gone(child), log.read_text()
        parent.kill()
        parent.wait(30)
        deadline = time.monotonic() + 10
        while not _gone(child) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _gone(child), "the child outlived its launcher by 10 s"
        assert "meshkit (rank 3): the launching process (rank 0, pid" in log.read_text()
    finally:
        parent.kill()
        if child is not None and not _gone(child):
            os.kill(child, signal.SIGKILL)


def test_no_watch_under_another_launcher(tmp_path):
    # the parent is a shell (as under an agent that is not Python): the rank keeps its own life
    code = "from meshkit.plugins.rendezvous import exit_with_parent; print(exit_with_parent(1))"
    out = subprocess.run(["sh", "-c", f'"{sys.executable}" -c "{code}"; true'], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


def test_a_stopped_child_is_ended_and_a_running_one_left_alone():
    # Lightning's launcher: rank 0 started ranks 1 and 2 here; rank 2 froze (SIGSTOP), rank 1 runs
    import signal
    import subprocess
    import sys
    import time

    running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    frozen = subprocess.Popen([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGSTOP)"])
    try:
        deadline = time.monotonic() + 30
        while open(f"/proc/{frozen.pid}/stat").read().split()[2] != "T" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert R.end_stopped_children([running, frozen], [2], first_rank=1) == [(2, frozen.pid)]
        assert frozen.returncode == -signal.SIGKILL and running.poll() is None
        note = R.timeout_note(RuntimeError("Timed out"), None, "0:00:20", 0, [2], [(2, frozen.pid)])
        assert note.endswith(f"the other ranks are alive. This process ended rank 2 (pid {frozen.pid}), which it had "
                             "started."), note
    finally:
        for p in (running, frozen):
            if p.poll() is None:
                p.kill()
                p.wait(10)
