"""Launch a job of real processes (torchrun's environment, one process per rank) and wait for it, bounded.

The fault tests kill, stop and corrupt; a ProcessPool would die with them, so each job is fresh.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Optional

from tests.dist_pool import free_port

ROOT = Path(__file__).resolve().parents[2]


def start(world: int, *args: str, devices_per_node: Optional[int] = None, extra_env: Optional[dict] = None,
          log_dir: Path) -> list[subprocess.Popen]:
    """``python -m tests.distributed.fault_worker ARGS`` on ``world`` ranks; output in ``log_dir/rank{r}.log``."""
    port, per_node = free_port(), devices_per_node or world
    procs = []
    for rank in range(world):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
               "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank % per_node), "NODE_RANK": str(rank // per_node),
               "LOCAL_WORLD_SIZE": str(per_node), "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), **(extra_env or {})}
        log = open(log_dir / f"rank{rank}.log", "w")
        procs.append(subprocess.Popen([sys.executable, "-m", "tests.distributed.fault_worker", *args], cwd=ROOT,
                                      env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
    return procs


def start_plain(*args: str, log_dir: Path) -> subprocess.Popen:
    """One ``python -m tests.distributed.fault_worker ARGS`` with no launcher environment: Lightning launches the rest."""
    drop = {"MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK", "LOCAL_WORLD_SIZE"}
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    log = open(log_dir / "rank0.log", "w")
    return subprocess.Popen([sys.executable, "-m", "tests.distributed.fault_worker", *args], cwd=ROOT, env=env,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def wait(procs: list[subprocess.Popen], timeout: float, until: Optional[Callable[[], bool]] = None) -> list[Optional[int]]:
    """Wait until every process exits (or ``until()`` holds) for at most ``timeout`` s; kill what is left."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(p.poll() is not None for p in procs) or (until is not None and until()):
            break
        time.sleep(0.2)
    codes = [p.poll() for p in procs]
    kill(procs)
    return codes


def kill(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait(10)


def logs(log_dir: Path) -> str:
    return "\n".join(f"--- {f.name}\n{f.read_text()[-3000:]}" for f in sorted(log_dir.glob("rank*.log")))
