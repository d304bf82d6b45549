"""Starting the process group, and naming who is at fault when that or a later collective fails.

Plain functions on addresses, ranks and timeouts (no Trainer, no Lightning object), called by
:class:`~meshkit.plugins.strategy.NDParallelStrategy`:

- :func:`rendezvous`: a roll call on the store torch's rendezvous is about to use (:func:`roll_call`),
  then the caller's ``init_process_group``; a rendezvous that cannot complete raises the same
  :func:`rendezvous_failed` message on every started rank, naming the ranks that never came.
- :func:`exit_with_parent`: a rank started by a Python parent (Lightning's own launcher) exits when
  that parent (rank 0) dies, instead of waiting out the timeout in its next collective.
- :func:`timeout_note`: the collective, mesh axis and ranks of a collective that timed out, read
  from torch.distributed's frames in the exception's traceback (:func:`is_timeout` says which
  exceptions are timeouts).

Example::

    >>> ranges([2, 3]), ranges([0]), ranges([0, 1, 2, 3, 5])
    ('ranks 2, 3', 'rank 0', 'ranks 0-3, 5')
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, Optional

if TYPE_CHECKING:
    from meshkit.plugins.dims import ParallelDims

__all__ = ["rendezvous", "roll_call", "rendezvous_failed", "stale_group", "group_state", "NO_GROUP", "LAUNCHER_ENDS",
           "ranges", "exit_with_parent", "is_timeout", "timeout_note", "end_stopped_children", "heartbeat",
           "stopped_ranks", "HEARTBEAT_S"]

VERDICT_GRACE = timedelta(seconds=30)
"""How much later than rank 0 the other ranks may give up waiting for its verdict."""
_roll_calls: dict[tuple[str, int], int] = {}  # per store: a second rendezvous on it (after destroy_process_group) asks anew
_parent_watch: Optional[threading.Thread] = None  # one watcher per process
HEARTBEAT_S = 1.0
"""How often each rank's heartbeat ticks on the job's store (one ``add`` per rank and period)."""
_heartbeat: Optional[tuple[tuple[str, int, int], threading.Thread, threading.Event]] = None  # one per process


def rendezvous(init_process_group: Callable[[], None], *, address: str, port: int, rank: int, devices: int,
               num_nodes: int, timeout: Optional[timedelta], initialized: bool = False,
               owner: str = "NDParallelStrategy") -> None:
    """Roll call (unless one process), then ``init_process_group()`` unless a group is ``initialized``; on
    failure raise ``RuntimeError(rendezvous_failed(...))`` on every started rank instead of torch's silent wait.

    ``devices`` processes per node on ``num_nodes`` nodes make the world; ``rank`` is this process's global
    rank. The roll call's store is kept until ``init_process_group`` has returned (on rank 0 torch's own
    store shares its server). A timeout, or the store's host giving up first (the peers then see the
    connection close: ``DistNetworkError``), becomes the rendezvous error; any other error propagates.

    A process group left from before (an earlier fit's, or the user's own ``init_process_group``) is reused only
    when every rank answers the roll call holding one that numbers it as the launcher does; otherwise every rank
    raises the same :func:`stale_group` error (a group destroyed on some ranks only, or a rank of it gone, used
    to hang in the first collective until the group's timeout).

    Example::

        >>> rendezvous(lambda: None, address="127.0.0.1", port=29500, rank=0, devices=1, num_nodes=1,
        ...            timeout=timedelta(seconds=10))  # one process: no roll call
    """
    world = devices * num_nodes
    where = f"{address}:{port}"
    missing: list[int] = []
    states: list[str] = []
    try:
        if world > 1:  # who is missing, named, before torch's silent wait
            # `store` stays referenced until this frame is gone: past init_process_group (rank 0's server)
            missing, store, states = roll_call(address, port, rank, world, timeout, per_node=devices,
                                               state=group_state() if initialized else NO_GROUP)
        if not missing and not initialized and not stale_group(states, world, owner):
            init_process_group()
    except RuntimeError as e:  # torch's DistStoreError / DistError are RuntimeErrors
        import torch.distributed as dist

        if not (is_timeout(e) or isinstance(e, dist.DistNetworkError)):
            raise
        raise RuntimeError(rendezvous_failed(where, devices, num_nodes, timeout, None, e, owner=owner)) from e
    if missing:
        message = rendezvous_failed(where, devices, num_nodes, timeout, missing, owner=owner)
        if initialized:  # this rank holds a group from before: its missing peers may have exited
            message += (f" This process holds a process group from before (world {world}): if {ranges(missing)} of it "
                        "exited, that group is stale; restart the job, so the launcher starts every rank anew.")
        raise RuntimeError(message)
    if (stale := stale_group(states, world, owner)) is not None:
        raise RuntimeError(stale)


LAUNCHER_ENDS = ("torchrun's agent stops the other workers when one exits, SIGKILL after 30 s; under SLURM run "
                 "`srun --kill-on-bad-exit=1`; Lightning's own launcher kills its processes when one fails; a stopped "
                 "launching process itself needs `kill -9`")
"""Who ends a rank's process that stopped responding (the timeout note says it; docs/errors.md tells it)."""

NO_GROUP = "none"
"""What a rank without a process group signs the roll call with (:func:`group_state` otherwise)."""


def group_state() -> str:
    """``"<world>:<rank>"`` of this process's default process group (call only when one is initialized)."""
    import torch.distributed as dist

    return f"{dist.get_world_size()}:{dist.get_rank()}"


def stale_group(states: list[str], world: int, owner: str = "NDParallelStrategy") -> Optional[str]:
    """The error every rank raises alike when the ranks' process groups (``states[r]``: :data:`NO_GROUP` or
    :func:`group_state`, as each rank signed the roll call) cannot be started or reused as one; None when every
    rank has none (start one) or every rank holds one of ``world`` ranks numbering it as the launcher does.

    Example::

        >>> stale_group(["4:0", "4:1", "4:2", "none"], 4)[:96]
        'NDParallelStrategy: the ranks do not hold the same process group: ranks 0-2 keep one from before'
    """
    if not states or all(s == NO_GROUP for s in states):
        return None
    held = [r for r, s in enumerate(states) if s != NO_GROUP]
    fix = ("Call `torch.distributed.destroy_process_group()` on every rank before this fit (meshkit then starts a "
           "fresh group), or on none of them; or restart the job.")
    if len(held) < len(states):
        none = [r for r, s in enumerate(states) if s == NO_GROUP]
        return (f"{owner}: the ranks do not hold the same process group: {ranges(held)} keep one from before (an "
                f"earlier fit's, or an `init_process_group` of their own) and {ranges(none)} "
                f"{'has' if len(none) == 1 else 'have'} none (destroyed there, or never started), so the ranks would "
                f"wait for each other in different groups until a timeout. {fix}")
    wrong = [(r, s) for r, s in enumerate(states) if s != f"{world}:{r}"]
    if wrong:
        shown = ", ".join(f"rank {r}: world {s.split(':')[0]}, group rank {s.split(':')[1]}" for r, s in wrong[:4])
        return (f"{owner}: the process group this job's ranks hold from before is not this job's: {shown} (the "
                f"launcher numbers {world} ranks 0-{world - 1}). It belongs to another job or an earlier layout, "
                f"and collectives over it would reach other processes than this fit's. {fix}")
    return None


def rendezvous_failed(where: str, devices: int, num_nodes: int, timeout: Any, missing: Optional[list[int]],
                      cause: Any = None, *, owner: str = "NDParallelStrategy") -> str:
    """The error every rank raises when the rendezvous at ``where`` does not complete: who is missing and the fix.

    Example::

        >>> rendezvous_failed("node0:29500", 2, 2, timedelta(seconds=10), [2, 3])[:97]
        'NDParallelStrategy: the process-group rendezvous did not complete within `timeout=0:00:10`: ranks'
    """
    world = devices * num_nodes
    if missing:
        arrived = sorted(set(range(world)) - set(missing))
        who = f"{ranges(missing)} of {world} did not join at {where} ({ranges(arrived)} did)"
    else:  # e.g. the store's host (rank 0) never came up: the others could not even ask
        who = f"{world} processes were expected at {where}, and not all arrived ({cause})"
    return (
        f"{owner}: the process-group rendezvous did not complete within `timeout={timeout}`: "
        f"{who}. `devices={devices}` × `num_nodes={num_nodes}` need {world} processes: start "
        f"`devices` processes on each of the `num_nodes` nodes (e.g. `torchrun --nnodes {num_nodes} "
        f"--nproc-per-node {devices}`), with NODE_RANK set per node, or lower `num_nodes`."
    )


def roll_call(
    address: str, port: int, rank: int, world: int, timeout: Optional[timedelta], per_node: int = 1,
    state: str = NO_GROUP,
) -> tuple[list[int], Any, list[str]]:
    """Every rank signs in on the store torch's rendezvous is about to use, with its ``state`` (what process group
    it holds: :func:`stale_group`): ``(ranks that never did, the store, every rank's state)``; the states are
    rank 0's reading, so every rank judges the same ones (empty when some rank is missing).

    Rank 0 hosts the TCPStore as torch's ``env://`` rendezvous does (multi-tenant: torch's own store in
    this process then shares its server, no second port), or, under torchrun's agent store, every
    rank is a client of the agent's. Keys live under ``meshkit/roll_call/<restart>/<n>/`` (``n``: this process's
    earlier roll calls on the same address and port, so ranks need a common history only per store). Each rank
    sets its key; rank 0 waits up to ``timeout`` for all ``world`` of them and publishes the missing
    ranks (none: milliseconds); the others wait for that verdict and tell rank 0 they read it, so
    every rank raises the same error before rank 0's exit closes the store. Rank 0 also waits (up to
    :data:`VERDICT_GRACE`) for its node's ``per_node`` ranks that came late (a slow start-up under
    Lightning's launcher), so they too read the verdict. Keep the store until the process group
    exists (rank 0's server lives in it).
    """
    from torch.distributed import TCPStore
    from torch.distributed.constants import default_pg_timeout

    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    wait = timeout if timeout is not None else default_pg_timeout
    store = TCPStore(address, int(port), None, is_master=rank == 0 and not agent, timeout=wait,
                     wait_for_workers=False, multi_tenant=True)
    n = _roll_calls[address, int(port)] = _roll_calls.get((address, int(port)), -1) + 1
    prefix = f"meshkit/roll_call/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{n}/"
    keys = [f"{prefix}{r}" for r in range(world)]
    store.set(keys[rank], state)

    def absent() -> list[int]:
        return [r for r, key in enumerate(keys) if not store.check([key])]

    if rank == 0:
        missing = [] if _waited(store, keys, wait) else absent()
        states = [] if missing else [store.get(key).decode() for key in keys]
        store.set(f"{prefix}verdict", json.dumps({"missing": missing, "states": states}))
        if missing or stale_group(states, world):  # everyone raises: keep the store up until they have read it
            readers = [r for r in range(1, world) if r not in missing or r < per_node]
            _waited(store, [f"{prefix}read/{r}" for r in readers], VERDICT_GRACE)
        return missing, store, states
    if not _waited(store, [f"{prefix}verdict"], wait + VERDICT_GRACE):
        return absent(), store, []  # rank 0 never gave one (it is missing itself, under an agent's store)
    verdict = json.loads(store.get(f"{prefix}verdict").decode())
    store.set(f"{prefix}read/{rank}", "1")
    return [int(r) for r in verdict["missing"]], store, [str(s) for s in verdict["states"]]


def _waited(store: Any, keys: list[str], timeout: timedelta) -> bool:
    try:
        store.wait(keys, timeout)
    except RuntimeError as e:  # DistStoreError: "wait timeout after ...ms"
        if not is_timeout(e):
            raise
        return False
    return True


def ranges(ranks: list[int]) -> str:
    """``[2, 3]`` -> ``"ranks 2, 3"``, ``[0]`` -> ``"rank 0"``, long runs ``[0..7]`` -> ``"ranks 0-7"``."""
    parts, start = [], None
    for i, r in enumerate(ranks):
        start = r if start is None else start
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            parts.append(str(r) if r == start else f"{start}, {r}" if r == start + 1 else f"{start}-{r}")
            start = None
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(parts)


def exit_with_parent(rank: int) -> bool:
    """This rank exits (status 1) within about a second of its parent's death, if the parent runs the same
    executable (a Python launcher that started the ranks itself, as Lightning's does); whether it watches.

    Without this such a rank waits in its next collective until ``timeout`` (issue 14: orphans alive 100 s
    later). torchrun and SLURM have agents of their own: the caller decides when to call this. One watcher
    per process: a process that runs many fits started one per fit before.
    """
    global _parent_watch
    if _parent_watch is not None and _parent_watch.is_alive():
        return True
    parent = os.getppid()
    try:
        if os.readlink(f"/proc/{parent}/exe") != os.readlink("/proc/self/exe"):
            return False
    except OSError:  # not Linux, or the parent is gone already
        return False

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        print(f"meshkit (rank {rank}): the launching process (rank 0, pid {parent}) died; "
              "exiting.", file=sys.stderr, flush=True)
        os._exit(1)

    _parent_watch = threading.Thread(target=watch, name="meshkit-launcher-watch", daemon=True)
    _parent_watch.start()
    return True


def _client(address: str, port: int, timeout: timedelta) -> Any:
    from torch.distributed import TCPStore

    return TCPStore(address, int(port), None, is_master=False, timeout=timeout, wait_for_workers=False,
                    multi_tenant=True)


def heartbeat(address: str, port: int, rank: int, period: float = HEARTBEAT_S) -> bool:
    """Tick ``meshkit/heartbeat/<rank>`` on the job's store every ``period`` seconds from a daemon thread, so
    that after a timeout :func:`stopped_ranks` can tell a rank whose process stopped (frozen, killed, out of
    memory: its ticks stop) from one that is alive but waiting. One thread per process (a later fit on the same
    store reuses it; on another store it replaces it); whether it ticks.
    """
    global _heartbeat
    where = (address, int(port), rank)
    if _heartbeat is not None:
        if _heartbeat[0] == where and _heartbeat[1].is_alive():
            return True
        _heartbeat[2].set()
    try:
        store = _client(address, port, timedelta(seconds=max(10.0, 5 * period)))
        store.add(f"meshkit/heartbeat/{rank}", 1)
    except (RuntimeError, ValueError):  # no store to tick on: the timeout note then says less
        _heartbeat = None
        return False
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(period):
            try:
                store.add(f"meshkit/heartbeat/{rank}", 1)
            except Exception:  # noqa: BLE001 - the store's host is gone: nothing left to tell
                return

    thread = threading.Thread(target=beat, name="meshkit-heartbeat", daemon=True)
    thread.start()
    _heartbeat = (where, thread, stop)
    return True


def stopped_ranks(address: str, port: int, world: int, period: float = HEARTBEAT_S) -> Optional[list[int]]:
    """The ranks whose heartbeat did not tick during ``3 x period`` seconds (their processes stopped), or None
    when the store does not answer (its host, rank 0 under ``env://``, may be the one that stopped)."""
    keys = [f"meshkit/heartbeat/{r}" for r in range(world)]
    try:
        store = _client(address, port, timedelta(seconds=max(5.0, 3 * period)))
        before = [store.add(k, 0) for k in keys]
        time.sleep(3 * period)
        after = [store.add(k, 0) for k in keys]
    except (RuntimeError, ValueError):
        return None
    return [r for r in range(world) if after[r] == before[r]]


def is_timeout(exception: BaseException) -> bool:
    """Whether ``exception`` is a (torch.distributed) timeout: a RuntimeError whose text says so."""
    text = str(exception).lower()
    return isinstance(exception, RuntimeError) and ("timed out" in text or "timeout" in text)


def end_stopped_children(children: list[Any], stopped: Optional[list[int]], first_rank: int) -> list[tuple[int, int]]:
    """SIGKILL the processes among ``children`` (``subprocess.Popen`` objects this process started: Lightning's
    launcher's ranks ``first_rank, first_rank + 1, ...`` of this node) whose ranks are in ``stopped``; the
    ``(rank, pid)`` of each ended. A frozen rank runs no code of its own, so no watcher of its own can end it,
    and once this process exits nothing would: it stayed behind, stopped, after the job had failed. Only
    children are touched (meshkit never signals a process it did not start: other nodes' are their launcher's).
    """
    ended = []
    for i, child in enumerate(children):
        if first_rank + i in (stopped or []) and child.poll() is None:
            child.kill()
            child.wait(10)
            ended.append((first_rank + i, child.pid))
    return ended


def timeout_note(exception: BaseException, dims: Optional[ParallelDims], timeout: Any, rank: int,
                 stopped: Optional[list[int]] = None, ended: Optional[list[tuple[int, int]]] = None) -> str:
    """Which collective and group the timed-out call was in (read from torch.distributed's frames) and, with
    ``stopped`` (:func:`stopped_ranks`), which ranks' processes stopped; ``ended``: those this process ended
    (:func:`end_stopped_children`).

    ``dims``: the job's layout (its mesh built), to name a group by its mesh axis; without it, or where the
    frames keep no group, the note names the collective and this rank's groups.
    """
    from torch.distributed import ProcessGroup, get_process_group_ranks

    built = dims is not None and dims._mesh is not None
    names: dict[str, list[str]] = {}
    if built:  # axes over the same ranks share one group (ParallelDims.build_mesh): name them all
        for axis in dims.order + tuple(dims._flat):
            names.setdefault(dims.submesh(axis).get_group().group_name, []).append(axis)
    collective, group = "a collective", None
    tb = exception.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_globals.get("__name__", "").startswith("torch.distributed"):
            collective = f"`{frame.f_code.co_name}`"
            found = [v for v in frame.f_locals.values() if isinstance(v, ProcessGroup)]
            group = found[0] if found else group
        tb = tb.tb_next
    if group is not None:
        axis = "` = `".join(names.get(group.group_name, [group.group_desc or group.group_name]))
        where = f" on group `{axis}` (ranks {get_process_group_ranks(group)})"
    else:  # e.g. a functional collective's wait_tensor keeps no group: list this rank's groups
        axes = {a: dims.submesh(a) for a in dims.order} if built else {}
        where = " on one of this rank's groups " + ", ".join(
            f"`{a}` {get_process_group_ranks(m.get_group())}" for a, m in axes.items() if m.size() > 1
        )
    head = f"meshkit (rank {rank}): {collective}{where} timed out after `timeout={timeout}`: "
    if stopped:
        left = [r for r in stopped if r not in {e for e, _ in ended or []}]
        done = "".join(f" This process ended rank {r} (pid {pid}), which it had started." for r, pid in ended or [])
        rest = (f" This rank exits with an error; meshkit ends no other rank's process (it may run on another node): "
                f"the launcher ends {'it' if len(left) == 1 else 'them'} ({LAUNCHER_ENDS}).") if left else ""
        return head + (
            f"{ranges(stopped)} stopped responding (no heartbeat for {3 * HEARTBEAT_S:.0f} s: frozen, killed or out of "
            f"memory). Look at {'its' if len(stopped) == 1 else 'their'} log and host; the other ranks are alive."
            + done + rest
        )
    if stopped == []:
        return head + (
            "every rank's process is alive (heartbeats tick), so a rank is stuck elsewhere: in another collective, "
            "or a computation longer than the timeout. Look at each rank's last step in its log; raise `timeout=` "
            "only if a step legitimately takes longer."
        )
    return head + (
        "another rank in that group stopped responding (crashed, frozen, out of memory, or it runs other "
        "collectives). Look for the rank that stopped in its own log; raise `timeout=` only if a step "
        "legitimately takes longer."
    )
