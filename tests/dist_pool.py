"""A pool of gloo processes that lives for one test module.

Spawning a process group costs seconds on a 2-core machine, so a test module
starts one pool (a module-scoped fixture) and runs every test's body on it::

    @pytest.fixture(scope="module")
    def pool():
        with ProcessPool(world_size=4) as p:
            yield p

    def _body(rank, world_size, x):        # module-level: it is imported by name
        return x * rank

    def test_something(pool):
        assert pool.run(_body, 3) == [0, 3, 6, 9]

Each worker has ``torch.distributed`` initialised (gloo, a timeout on every
collective), the environment a launcher such as torchrun would give it
(``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``NODE_RANK``, ``MASTER_ADDR``,
``MASTER_PORT``), so Lightning treats it as externally launched, and one
intra-op thread. ``run`` raises with every failing rank's traceback; a task
that does not finish in ``timeout`` seconds kills the pool (the next ``run``
starts a fresh one) so a bug fails instead of hanging the suite.
"""

from __future__ import annotations

import importlib
import os
import queue
import socket
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch.multiprocessing as mp

COLLECTIVE_TIMEOUT_S = 90


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PRELOAD = ("torch", "torch.distributed", "lightning.pytorch", "meshkit.plugins.strategy", "tests.dist_pool")
"""What the pools' fork server imports once per test session (~4 s of CPU per rank on the 2-core machine, paid
by every rank of every pool when each was a fresh ``spawn``). Importing them starts no thread (checked: 1
thread after all four), so forking the server is safe."""


def _context() -> Any:
    """Workers are forked from one server per session that has imported :data:`PRELOAD`; each starts clean (no
    state but those imports), as a spawned one did. Falls back to ``spawn`` where there is no fork server."""
    import multiprocessing

    if "forkserver" not in multiprocessing.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


def _worker(rank: int, world_size: int, devices_per_node: int, port: int, tasks: Any, results: Any,
            environ: dict[str, str] | None = None, cwd: str | None = None) -> None:
    if environ is not None:  # the parent's environment and folder now, not the fork server's from its start
        os.environ.clear()
        os.environ.update(environ)
    if cwd is not None:
        os.chdir(cwd)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank % devices_per_node),
        NODE_RANK=str(rank // devices_per_node),
        LOCAL_WORLD_SIZE=str(devices_per_node),
        OMP_NUM_THREADS="1",
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S)
        )
    except Exception:  # noqa: BLE001 - reported to the parent
        results.put((rank, False, traceback.format_exc()))
        return
    while True:
        task = tasks.get()
        if task is None:
            break
        module, name, args, kwargs = task
        # Lightning's environment teardown deletes WORLD_SIZE; every task starts from the launcher's view.
        os.environ["WORLD_SIZE"] = str(world_size)
        try:
            fn = getattr(importlib.import_module(module), name)
            results.put((rank, True, fn(rank, world_size, *args, **kwargs)))
        except BaseException:  # noqa: BLE001 - reported to the parent
            results.put((rank, False, traceback.format_exc()))
    if dist.is_initialized():
        dist.destroy_process_group()


class ProcessPool:
    """``world_size`` gloo processes, ``devices_per_node`` to a simulated node."""

    def __init__(self, world_size: int, devices_per_node: int | None = None, timeout: float = 300.0) -> None:
        self.world_size = world_size
        self.devices_per_node = devices_per_node or world_size
        self.timeout = timeout
        self._procs: list[Any] = []
        self._start()

    def _start(self) -> None:
        ctx = _context()
        port = free_port()
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        self._procs = [
            ctx.Process(
                target=_worker,
                args=(r, self.world_size, self.devices_per_node, port, self._tasks[r], self._results,
                      dict(os.environ), os.getcwd()),
                daemon=True,
            )
            for r in range(self.world_size)
        ]
        for p in self._procs:
            p.start()

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None, **kwargs: Any) -> list[Any]:
        """Run ``fn(rank, world_size, *args, **kwargs)`` on every rank; return the results by rank."""
        if not self._procs:
            self._start()
        for q in self._tasks:
            q.put((fn.__module__, fn.__name__, args, kwargs))
        out: dict[int, Any] = {}
        errors: dict[int, str] = {}
        limit = timeout or self.timeout
        try:
            while len(out) + len(errors) < self.world_size:
                rank, ok, value = self._results.get(timeout=limit)
                (out if ok else errors)[rank] = value
        except queue.Empty:
            self.close(kill=True)
            raise TimeoutError(
                f"{fn.__name__} did not finish on ranks {sorted(set(range(self.world_size)) - set(out) - set(errors))}"
                f" within {limit}s; the pool was killed. Errors so far: {errors}"
            ) from None
        if errors:
            # Ranks that did not fail may be stuck on a peer; restart the pool for the next test.
            self.close(kill=True)
            msg = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
            raise AssertionError(f"{fn.__name__} failed on ranks {sorted(errors)}:\n{msg}")
        return [out[r] for r in range(self.world_size)]

    def close(self, kill: bool = False) -> None:
        if not kill:
            for q in self._tasks:
                q.put(None)
            for p in self._procs:
                p.join(timeout=30)
        for p in self._procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
        self._procs = []

    def __enter__(self) -> "ProcessPool":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
