"""Launch a job of real processes (torchrun's environment, one process per rank) and wait for it, bounded.

The fault tests kill, stop and corrupt; a ProcessPool would die with them, so each job is fresh processes.
A fresh ``python -m`` per rank paid the import of torch + Lightning + meshkit (5-10 s on the shared 2-core
box) each time, so the ranks are forked instead from one fork server per test session, started on first use
(``python -m tests.distributed.jobs``): it imports what a rank needs (``PRELOAD``) and never runs a fit,
creates no process group and, checked before every fork, no thread (``OMP_NUM_THREADS=1``, so not even
OpenMP's pool), then forks one child per rank on request. The child is what ``python -m
tests.distributed.fault_worker ARGS`` would be: its own session (``os.killpg`` kills exactly that rank), the
rank's environment and working folder, stdin from /dev/null, stdout and stderr into the rank's log, and the
worker run by ``runpy`` as ``__main__`` (``__main__.__spec__`` names the module, as Lightning's launcher
needs to start the other ranks of ``start_plain``). The test gets a :class:`Rank`: the child's real pid (to
SIGKILL, SIGSTOP, look up in /proc) and ``poll``/``wait``/``returncode`` as ``subprocess.Popen`` has them,
fed by the exit statuses that the server, the child's parent, reaps and reports over a pipe. What a fork
does not give a rank is its own interpreter start: the session's ranks share the server's str hash seed and
numpy's global RNG state (torch's default generator is at its fixed default seed either way; Python's
``random`` reseeds on fork). The fault workers depend on neither; tests/dist_pool.py's pools still spawn::

    ranks = start(2, "save", str(d), "none", "-1", log_dir=d)
    assert wait(ranks, 300) == [0, 0], logs(d)
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import runpy
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

__all__ = ["ForkServer", "Rank", "alive", "kill", "logs", "start", "start_plain", "wait"]

ROOT = Path(__file__).resolve().parents[2]
WORKER = "tests.distributed.fault_worker"
# What a fault rank imports (the worker's own lazy imports included): loaded once, in the server.
PRELOAD = ("torch", "torch.distributed.checkpoint", "torch.utils.data", "lightning", "lightning.pytorch.callbacks",
           "meshkit", "meshkit.plugins.strategy", "meshkit.plugins.checkpoint", "meshkit.models.llama", WORKER)
LAUNCH_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK", "LOCAL_WORLD_SIZE")
SPAWN_TIMEOUT_S = 300  # the first spawn waits for the server's imports


def _env() -> dict[str, str]:
    """This process's environment without a launcher's variables, one intra-op thread, this tree first."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return env


class Rank:
    """A forked rank, as much of ``subprocess.Popen`` as the tests use: ``pid``, ``returncode`` (negative: the
    signal that killed it), ``poll()`` and ``wait(timeout)``."""

    def __init__(self, server: "ForkServer", pid: int) -> None:
        self.pid, self.returncode, self._server = pid, None, server

    def poll(self) -> Optional[int]:
        with self._server._cond:
            self._server._check(self)
            return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        with self._server._cond:
            if not self._server._cond.wait_for(lambda: self.returncode is not None or self._server._gone, timeout):
                raise subprocess.TimeoutExpired(f"rank pid {self.pid}", timeout)
            self._server._check(self)
            return self.returncode


class ForkServer:
    """A process that has imported ``preload`` and forks a :class:`Rank` per :meth:`spawn`."""

    def __init__(self, preload: Sequence[str] = PRELOAD) -> None:
        self.log = Path(tempfile.mkdtemp(prefix="meshkit-forkserver-")) / "server.log"
        with open(self.log, "w") as err:
            self._proc = subprocess.Popen([sys.executable, "-m", "tests.distributed.jobs", *preload], cwd=ROOT,
                                          env=_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err)
        self._cond = threading.Condition()
        self._gone = False
        self._requests = 0
        self._spawned: dict[int, Rank] = {}  # request id -> its rank, until spawn() takes it
        self._living: dict[int, Rank] = {}  # pid -> rank, until its exit status comes
        threading.Thread(target=self._read, name="forkserver-reader", daemon=True).start()

    def spawn(self, module: str, args: Sequence[str], env: dict[str, str], log: Path, cwd: Path = ROOT) -> Rank:
        """``python -m MODULE ARGS`` with exactly ``env``, output in ``log`` (created before this returns)."""
        log.write_text("")
        with self._cond:
            self._requests += 1
            rid = self._requests
            request = {"id": rid, "module": module, "args": list(args), "env": env, "log": str(log), "cwd": str(cwd)}
            try:
                self._proc.stdin.write(json.dumps(request).encode() + b"\n")
                self._proc.stdin.flush()
            except BrokenPipeError:
                pass  # the server is gone: the wait below says so
            self._cond.wait_for(lambda: rid in self._spawned or self._gone, SPAWN_TIMEOUT_S)
            if rid not in self._spawned:
                raise RuntimeError(f"the fork server did not fork `{module}` within {SPAWN_TIMEOUT_S} s "
                                   f"(exit {self._proc.poll()}); its log {self.log}:\n{self._tail()}")
            return self._spawned.pop(rid)

    def close(self) -> None:
        """End the server (its ranks live on, each in its own session, as Popen's did)."""
        if self._proc.poll() is None:
            self._proc.stdin.close()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()

    def _read(self) -> None:
        for line in self._proc.stdout:
            msg = json.loads(line)
            with self._cond:
                if "id" in msg:
                    rank = self._living[msg["pid"]] = Rank(self, msg["pid"])
                    self._spawned[msg["id"]] = rank
                elif msg["pid"] in self._living:  # not a child some preloaded import left unreaped
                    self._living.pop(msg["pid"]).returncode = msg["code"]
                self._cond.notify_all()
        with self._cond:
            self._gone = True
            self._cond.notify_all()

    def _check(self, rank: Rank) -> None:
        if rank.returncode is None and self._gone:
            raise RuntimeError(f"the fork server died (exit {self._proc.poll()}) before rank pid {rank.pid} ended, "
                               f"so its exit status is lost; its log {self.log}:\n{self._tail()}")

    def _tail(self) -> str:
        return self.log.read_text()[-3000:] if self.log.exists() else ""


_server: Optional[ForkServer] = None
_server_lock = threading.Lock()


def _the_server() -> ForkServer:
    """The session's fork server, started on first use (a dead one is replaced)."""
    global _server
    with _server_lock:
        if _server is None or _server._gone:
            _server = ForkServer()
            atexit.register(_server.close)
        return _server


def start(world: int, *args: str, devices_per_node: Optional[int] = None, extra_env: Optional[dict] = None,
          log_dir: Path) -> list[Rank]:
    """``python -m tests.distributed.fault_worker ARGS`` on ``world`` ranks; output in ``log_dir/rank{r}.log``."""
    from tests.dist_pool import free_port  # not at the top: the server itself imports only its PRELOAD

    port, per_node, server = free_port(), devices_per_node or world, _the_server()
    ranks = []
    for rank in range(world):
        env = {**_env(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
               "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank % per_node), "NODE_RANK": str(rank // per_node),
               "LOCAL_WORLD_SIZE": str(per_node), **(extra_env or {})}
        ranks.append(server.spawn(WORKER, args, env, log_dir / f"rank{rank}.log"))
    return ranks


def start_plain(*args: str, log_dir: Path) -> Rank:
    """One ``python -m tests.distributed.fault_worker ARGS`` with no launcher environment: Lightning launches the
    rest (fresh ``python -m`` processes of its own, children of this forked one)."""
    return _the_server().spawn(WORKER, args, _env(), log_dir / "rank0.log")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def wait(procs: list[Rank], timeout: float, until: Optional[Callable[[], bool]] = None) -> list[Optional[int]]:
    """Wait until every process exits (or ``until()`` holds) for at most ``timeout`` s; kill what is left."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(p.poll() is not None for p in procs) or (until is not None and until()):
            break
        time.sleep(0.2)
    codes = [p.poll() for p in procs]
    kill(procs)
    return codes


def kill(procs: list[Rank]) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait(10)


def logs(log_dir: Path) -> str:
    return "\n".join(f"--- {f.name}\n{f.read_text()[-3000:]}" for f in sorted(log_dir.glob("rank*.log")))


# ---- the server side: `python -m tests.distributed.jobs PRELOAD...` -----------------------------------------

def _report(**msg: int) -> None:
    os.write(1, json.dumps(msg).encode() + b"\n")  # fd 1 is the pipe to ForkServer._read; never buffered


def _reap() -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)  # not WUNTRACED: a SIGSTOPped rank is alive
        except ChildProcessError:
            return
        if pid == 0:
            return
        _report(pid=pid, code=os.waitstatus_to_exitcode(status))


def _fork(request: dict) -> int:
    """Fork one rank; in the child, become it (session, fds, environment, folder) and return 0."""
    threads = os.listdir("/proc/self/task")
    if len(threads) != 1:
        raise RuntimeError(f"the fork server has {len(threads)} threads; a forked rank would inherit their "
                           "locks but not them (is OMP_NUM_THREADS=1? did a preloaded module start a thread?)")
    sys.stdout.flush()
    sys.stderr.flush()
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid:
        os.close(ready_w)
        os.read(ready_r, 1)  # end of file once the child leads its own session: killpg(pid) reaches it
        os.close(ready_r)
        return pid
    os.close(ready_r)
    os.setsid()
    os.close(ready_w)
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)  # off the request pipe
    os.dup2(log, 1)  # off the report pipe
    os.dup2(log, 2)
    os.close(log)
    os.close(null)
    os.chdir(request["cwd"])
    sys.path[0] = os.getcwd()  # `python -m`'s first entry: the folder it starts in
    os.environ.clear()
    os.environ.update(request["env"])
    return 0


def _serve(preload: Sequence[str]) -> Optional[dict]:
    """Import ``preload``, then fork a rank per request line on stdin and report its pid and, when it ends, its
    exit status on stdout. Returns the request in a forked child; ``None`` when stdin closes (the session ended)."""
    for name in preload:
        importlib.import_module(name)
    inbox = b""
    while True:
        _reap()
        if not select.select([0], [], [], 0.05)[0]:
            continue
        chunk = os.read(0, 1 << 16)
        if not chunk:
            return None
        inbox += chunk
        while b"\n" in inbox:
            line, inbox = inbox.split(b"\n", 1)
            request = json.loads(line)
            pid = _fork(request)
            if pid == 0:
                return request
            _report(id=request["id"], pid=pid)


if __name__ == "__main__":
    request = _serve(sys.argv[1:])
    if request is not None:  # a forked rank: run the module as `python -m` would (sys.argv[0] becomes its path)
        sys.modules.pop(request["module"], None)  # preloaded as a module; it runs afresh as __main__
        sys.argv = ["-m", *request["args"]]
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
