"""Kineto (torch.profiler) trace loading, event classification and interval algebra.

A trace file (``*.pt.trace.json`` or ``.json.gz``, as ``tensorboard_trace_handler`` writes) is
read in a streaming pass: the ``traceEvents`` array is decoded a few megabytes at a time by
msgspec into typed records holding only the fields the analysis reads, and each event is
reduced, on the spot, to a few numbers (compact float arrays), so memory stays bounded by the
chunk size plus ~16 bytes per kept event.

Two trace shapes are recognized:

- **CUDA / NCCL**: device events (``cat == "kernel"``) are compute, except NCCL kernels
  (name contains ``nccl``), which are communication; ``gpu_memcpy`` / ``gpu_memset`` are memory.
  Kernels are assigned to steps through their CUDA-runtime launch (``correlation``) falling
  inside a ``ProfilerStep#N`` span.
- **CPU / gloo** (no kernels): ``gloo:*`` / ``nccl:*`` spans (recorded on the process group's
  worker threads) are communication; ``cpu_op`` events on the step's thread are compute
  (``c10d::*`` and ``record_param_comms`` are excluded: they only enqueue or wait).

Spans named ``PP:*`` are pipeline actions. Times are kept in microseconds, as Kineto writes them.
"""

from __future__ import annotations

import gzip
import io
import itertools
import json
import operator
import os
import re
import zlib
from array import array
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence, Union

import msgspec
import numpy as np

__all__ = ["Intervals", "RankTrace", "TraceLoadError", "find_trace_files", "load_trace", "load_rank_traces"]

CHUNK_BYTES = 1 << 22  # 4 MiB per read
_NCCL_COLL = re.compile(r"nccl(?:Dev)?Kernel_([A-Za-z]+)", re.IGNORECASE)


class TraceLoadError(ValueError):
    """A trace directory or file that cannot be analysed at all."""


# --------------------------------------------------------------------------- interval algebra


class Intervals:
    """A union of disjoint, sorted half-open intervals ``[start, end)`` with a cumulative measure.

    Built from any (possibly overlapping, unsorted) intervals in O(n log n) with numpy;
    :meth:`measure` of many windows is one ``searchsorted``.

    >>> u = Intervals.union([0, 5, 2], [3, 6, 4])   # [0,3) ∪ [2,4) ∪ [5,6) = [0,4) ∪ [5,6)
    >>> u.starts.tolist(), u.ends.tolist(), u.total
    ([0.0, 5.0], [4.0, 6.0], 5.0)
    >>> u.measure([0, 3.5], [10, 5.5]).tolist()      # inside [0,10) and [3.5,5.5)
    [5.0, 1.0]
    """

    __slots__ = ("starts", "ends", "_cum")

    def __init__(self, starts: np.ndarray, ends: np.ndarray) -> None:
        self.starts, self.ends = starts, ends
        self._cum = np.concatenate([[0.0], np.cumsum(ends - starts)])

    @classmethod
    def union(cls, starts: Any, ends: Any) -> "Intervals":
        s = np.asarray(starts, dtype=np.float64)
        e = np.asarray(ends, dtype=np.float64)
        keep = e > s
        s, e = s[keep], e[keep]
        if s.size == 0:
            return cls(np.empty(0), np.empty(0))
        order = np.argsort(s, kind="stable")
        s, e = s[order], e[order]
        run_end = np.maximum.accumulate(e)
        breaks = s[1:] > run_end[:-1]
        first = np.concatenate([[True], breaks])
        last = np.concatenate([breaks, [True]])
        return cls(s[first], run_end[last])

    @classmethod
    def union_of(cls, *parts: "Intervals") -> "Intervals":
        return cls.union(np.concatenate([p.starts for p in parts]), np.concatenate([p.ends for p in parts]))

    @property
    def total(self) -> float:
        return float(self._cum[-1])

    def __len__(self) -> int:
        return int(self.starts.size)

    def _covered_before(self, t: np.ndarray) -> np.ndarray:
        i = np.searchsorted(self.starts, t, side="right") - 1  # last interval starting at or before t
        ic = np.maximum(i, 0)
        inside = np.clip(t - self.starts[ic], 0, self.ends[ic] - self.starts[ic])
        return np.where(i >= 0, self._cum[ic] + inside, 0.0)

    def measure(self, lo: Any, hi: Any) -> np.ndarray:
        """Covered length inside each window ``[lo[k], hi[k])``."""
        lo = np.asarray(lo, dtype=np.float64)
        hi = np.asarray(hi, dtype=np.float64)
        if len(self) == 0:
            return np.zeros(np.broadcast(lo, hi).shape)
        return np.maximum(self._covered_before(hi) - self._covered_before(lo), 0.0)


def intersection_measure(a: Intervals, b: Intervals, lo: Any, hi: Any) -> np.ndarray:
    """|A ∩ B| inside each window, as |A| + |B| − |A ∪ B| (inclusion–exclusion)."""
    return a.measure(lo, hi) + b.measure(lo, hi) - Intervals.union_of(a, b).measure(lo, hi)


# ------------------------------------------------------------------------------ rank trace


@dataclass
class RankTrace:
    """What one rank's trace files say, reduced to arrays (µs)."""

    rank: int
    paths: list[str]
    shape: str = "cpu"
    """``"cuda"`` when device kernels are present, else ``"cpu"``."""
    world_size: int | None = None
    host: str | None = None
    step_ids: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))
    step_windows: np.ndarray = field(default_factory=lambda: np.empty((0, 2)))
    """(S, 2) start, end of each step on the timeline that is analysed (device for CUDA)."""
    compute: Intervals = field(default_factory=lambda: Intervals.union([], []))
    comm: Intervals = field(default_factory=lambda: Intervals.union([], []))
    memory: Intervals = field(default_factory=lambda: Intervals.union([], []))
    pipeline: Intervals = field(default_factory=lambda: Intervals.union([], []))
    """Union of ``PP:*`` spans (pipeline actions), if the run recorded them."""
    collectives: list[tuple[str, float, float]] = field(default_factory=list)
    """(collective name, start, end) in start order: arrival order for straggler matching."""
    events: int = 0
    bytes: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def partial(self) -> bool:
        return bool(self.problems)


class _Args(msgspec.Struct, gc=False):
    correlation: Union[int, float, None] = None


class _Event(msgspec.Struct, gc=False):
    """The fields of a Kineto event the analysis reads; msgspec skips every other field unparsed."""

    ph: str = ""
    cat: str = ""
    name: str = ""
    ts: Union[float, None] = None
    dur: Union[float, None] = None
    tid: Union[int, str, None] = None
    args: Union[_Args, None] = None


_SKIP = _Event()
_NOT_COMPUTE = ("gloo:", "nccl:", "PP:", "c10d::")
_CAT = operator.attrgetter("cat")
_DECODE_BATCH = msgspec.json.Decoder(list[_Event]).decode


def _coerce(ev: Any) -> _Event:
    """An event decoded as plain JSON (a file that does not match the typed schema), read loosely."""
    if not isinstance(ev, dict):
        return _SKIP
    try:
        ts, dur = (None if ev.get(k) is None else float(ev[k]) for k in ("ts", "dur"))
    except (TypeError, ValueError):
        return _SKIP
    args, corr = ev.get("args"), None
    if isinstance(args, dict) and isinstance(args.get("correlation"), (int, float)):
        corr = _Args(args["correlation"])
    tid = ev.get("tid")
    return _Event(str(ev.get("ph", "")), str(ev.get("cat", "")), str(ev.get("name", "")), ts, dur,
                  tid if isinstance(tid, (int, str)) else None, corr)


class _Sink:
    """Per-file accumulator: classify each event as it streams past."""

    def __init__(self) -> None:
        f = lambda: array("d")  # noqa: E731
        self.kern_s, self.kern_e, self.kern_corr = f(), f(), f()
        self.comm_k_s, self.comm_k_e, self.comm_k_corr = f(), f(), f()
        self.comm_k_names: list[str] = []
        self.mem_s, self.mem_e = f(), f()
        self.rt_ts, self.rt_corr = f(), f()
        self.cpu_s, self.cpu_e, self.cpu_tid = f(), f(), f()
        self.ccomm_s, self.ccomm_e = f(), f()
        self.ccomm_names: list[str] = []
        self.pp_s, self.pp_e = f(), f()
        self.steps: list[tuple[int, float, float, Any]] = []
        self.events = 0

    def add(self, batch: list[_Event]) -> None:
        """Classify a batch: complete ("X") events grouped by category, each group in bulk."""
        self.events += len(batch)
        complete = sorted((ev for ev in batch if ev.ph == "X" and ev.ts is not None), key=_CAT)
        for cat, group in itertools.groupby(complete, key=_CAT):
            evs = list(group)
            if cat in ("cpu_op", "user_annotation", "python_function"):
                self._host(cat, evs)
            elif cat == "kernel":
                nccl, compute = [], []
                for ev in evs:
                    (nccl if "nccl" in ev.name.lower() else compute).append(ev)
                _spans(nccl, self.comm_k_s, self.comm_k_e, self.comm_k_corr)
                _spans(compute, self.kern_s, self.kern_e, self.kern_corr)
                for ev in nccl:
                    m = _NCCL_COLL.search(ev.name)
                    self.comm_k_names.append(m.group(1) if m else ev.name)
            elif cat in ("gpu_memcpy", "gpu_memset"):
                _spans(evs, self.mem_s, self.mem_e)
            elif cat in ("cuda_runtime", "cuda_driver", "hip_runtime"):
                evs = [ev for ev in evs if ev.args is not None and ev.args.correlation is not None]
                self.rt_ts.extend([ev.ts for ev in evs])
                self.rt_corr.extend([float(ev.args.correlation) for ev in evs])  # type: ignore[union-attr,arg-type]

    def _host(self, cat: str, evs: list[_Event]) -> None:
        for ev in evs:  # comm and pipeline spans: few
            if ev.name.startswith(("gloo:", "nccl:")):
                self.ccomm_s.append(ev.ts), self.ccomm_e.append(ev.ts + (ev.dur or 0.0))
                self.ccomm_names.append(ev.name)
            elif ev.name.startswith("PP:"):
                self.pp_s.append(ev.ts), self.pp_e.append(ev.ts + (ev.dur or 0.0))
        if cat == "cpu_op":  # compute: every aten op but comm spans and c10d's enqueue/wait ops
            ops = [ev for ev in evs if not ev.name.startswith(_NOT_COMPUTE) and ev.name != "record_param_comms"]
            _spans(ops, self.cpu_s, self.cpu_e)
            self.cpu_tid.extend([float(ev.tid) if isinstance(ev.tid, int) else -1.0 for ev in ops])
        elif cat == "user_annotation":
            for ev in evs:
                if ev.name.startswith("ProfilerStep#") and ev.name[13:].isdigit():
                    self.steps.append((int(ev.name[13:]), ev.ts, ev.ts + (ev.dur or 0.0), ev.tid))


def _spans(evs: list[_Event], starts: array, ends: array, corr: array | None = None) -> None:
    """Append the events' [start, end) (and CUDA correlation ids, -1 where absent)."""
    starts.extend([ev.ts for ev in evs])  # type: ignore[misc]
    ends.extend([ev.ts + (ev.dur or 0.0) for ev in evs])  # type: ignore[operator]
    if corr is not None:
        corr.extend([float(ev.args.correlation) if ev.args and ev.args.correlation is not None else -1.0
                     for ev in evs])


# ---------------------------------------------------------------------------- streaming parse


def _open_binary(path: str) -> io.BufferedIOBase:
    with open(path, "rb") as f:
        magic = f.read(2)
    if path.endswith(".gz") or magic == b"\x1f\x8b":
        return gzip.open(path, "rb")  # type: ignore[return-value]
    return open(path, "rb")


class _Truncated(Exception):
    pass


class _Prefixed(io.RawIOBase):
    """A binary stream that yields ``head`` and then the rest of ``reader``."""

    def __init__(self, head: bytes, reader: io.BufferedIOBase) -> None:
        self._head, self._reader = head, reader

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        data = self._head[:len(b)] if self._head else self._reader.read(len(b))
        self._head = self._head[len(data):] if self._head else b""
        b[:len(data)] = data
        return len(data)


_SEP = b"\n  },"  # Kineto closes every event with this; it cannot occur inside a JSON string


def _stream_events(reader: io.BufferedIOBase, meta: dict) -> Iterator[list[_Event]]:
    """Yield the elements of the top-level ``traceEvents`` array in batches, reading CHUNK_BYTES at a time.

    Kineto's layout is cut into batches of whole events after its ``"\\n  },"`` separator, and each
    batch is decoded by msgspec straight into :class:`_Event` (unread fields are skipped, not
    built). A batch whose values do not fit the schema is decoded as plain JSON and read loosely;
    any other layout falls back to one stdlib ``raw_decode`` per event. Top-level keys before and
    after the array are parsed into ``meta``.
    """
    buf, eof = b"", False

    def more() -> bool:
        nonlocal buf, eof
        chunk = b"" if eof else reader.read(CHUNK_BYTES)
        eof = eof or not chunk
        buf += chunk
        return bool(chunk)

    while True:  # header: everything up to '"traceEvents"' and its '['
        i = buf.find(b'"traceEvents"')
        j = buf.find(b"[", i) if i >= 0 else -1
        if j >= 0:
            break
        if not more():
            raise _Truncated("the file is empty" if not buf.strip() else
                             "no `traceEvents` array (not a torch.profiler trace?)")
    head = buf[:i].rstrip().rstrip(b",")
    try:
        meta.update(json.loads(head + b"}") if head.strip() != b"{" else {})
    except ValueError:
        pass
    buf = buf[j + 1:]
    while True:
        cut = buf.rfind(_SEP)
        while cut < 0 and len(buf) < 4 * CHUNK_BYTES and more():
            cut = buf.rfind(_SEP)
        if cut < 0:
            break  # the last event, or not Kineto's layout: the slow path reads the rest
        body = buf[:cut + 4].lstrip(b" \t\r\n,")
        try:
            batch = _DECODE_BATCH(b"[" + body + b"]")
        except msgspec.ValidationError:
            batch = [_coerce(ev) for ev in msgspec.json.decode(b"[" + body + b"]")]
        except msgspec.DecodeError:
            break  # not Kineto's layout after all
        meta["_batches"] = meta.get("_batches", 0) + 1
        yield batch
        buf = buf[cut + 5:]
        if len(buf) < CHUNK_BYTES:
            more()
    text = io.TextIOWrapper(io.BufferedReader(_Prefixed(buf, reader)), encoding="utf-8", errors="replace")
    yield from _stream_slow(text, meta)


def _stream_slow(reader: io.TextIOBase, meta: dict) -> Iterator[list[_Event]]:
    """The rest of the ``traceEvents`` array (after its ``[``), one ``raw_decode`` per event, then the tail."""
    decoder = json.JSONDecoder()
    buf, pos, eof = "", 0, False

    def more() -> bool:
        nonlocal buf, eof
        chunk = "" if eof else reader.read(CHUNK_BYTES)
        eof = eof or not chunk
        buf += chunk
        return bool(chunk)

    while True:
        while True:  # skip whitespace and commas
            while pos < len(buf) and buf[pos] in " \t\r\n,":
                pos += 1
            if pos < len(buf) or not more():
                break
        if pos >= len(buf):
            raise _Truncated("the `traceEvents` array ends early (truncated file)")
        if buf[pos] == "]":
            pos += 1
            break
        try:
            ev, end = decoder.raw_decode(buf, pos)
        except ValueError:
            if more():
                continue
            raise _Truncated("the `traceEvents` array ends early (truncated file)")
        yield [_coerce(ev)]
        pos = end
        if pos > CHUNK_BYTES:
            buf, pos = buf[pos:], 0
    while more():  # tail: remaining top-level keys (e.g. "traceName")
        pass
    tail = buf[pos:].strip().lstrip(",").strip()
    if tail and tail != "}":
        try:
            meta.update(json.loads("{" + tail))
        except ValueError:
            pass


def load_trace(path: str) -> tuple[_Sink, dict, list[str]]:
    """Stream one trace file into a classification sink; returns (sink, top-level metadata, problems).

    Never raises for bad content: an empty, truncated or corrupt file yields what could be read
    and a problem string saying why (the caller flags the rank as partial).
    """
    sink, meta, problems = _Sink(), {}, []
    try:
        with _open_binary(path) as reader:
            for batch in _stream_events(reader, meta):
                sink.add(batch)
    except _Truncated as exc:
        problems.append(f"{os.path.basename(path)}: {exc}; kept {sink.events} events read before it")
    except (EOFError, gzip.BadGzipFile, zlib.error) as exc:
        problems.append(f"{os.path.basename(path)}: corrupt or truncated gzip ({exc}); "
                        f"kept {sink.events} events read before it")
    except OSError as exc:
        problems.append(f"{os.path.basename(path)}: unreadable ({exc})")
    return sink, meta, problems


_TRACE_NAME = re.compile(r"trace.*\.json(\.gz)?$")


def find_trace_files(logdir: str) -> list[str]:
    """Trace files under ``logdir`` (recursive): names ending ``.json``/``.json.gz`` containing "trace"."""
    if not os.path.isdir(logdir):
        if os.path.isfile(logdir):
            return [logdir]
        raise TraceLoadError(f"analyze: `logdir={logdir!r}` does not exist. Pass the directory the profiler wrote to.")
    found = []
    for root, _, files in os.walk(logdir):
        found.extend(os.path.join(root, f) for f in files if _TRACE_NAME.search(f))
    return sorted(found)


_RANK_IN_NAME = re.compile(r"rank[_-]?(\d+)", re.IGNORECASE)


def _rank_of(path: str, meta: dict) -> int | None:
    info = meta.get("distributedInfo") or {}
    if isinstance(info.get("rank"), int):
        return info["rank"]
    m = _RANK_IN_NAME.search(os.path.basename(path))
    return int(m.group(1)) if m else None


def _arr(a: array) -> np.ndarray:
    return np.frombuffer(a, dtype=np.float64) if len(a) else np.empty(0)


def _build(rank: int, paths: list[str], sinks: list[_Sink], metas: list[dict], problems: list[str]) -> RankTrace:
    rt = RankTrace(rank=rank, paths=paths, problems=list(problems))
    rt.events = sum(s.events for s in sinks)
    rt.bytes = sum(os.path.getsize(p) for p in paths if os.path.exists(p))
    for meta in metas:
        info = meta.get("distributedInfo") or {}
        if isinstance(info.get("world_size"), int):
            rt.world_size = info["world_size"]
        rt.host = meta.get("host_name", rt.host)
    cat = lambda name: np.concatenate([_arr(getattr(s, name)) for s in sinks]) if sinks else np.empty(0)  # noqa
    steps = sorted({st[0]: st for s in sinks for st in s.steps}.values())
    kern_s, kern_e = cat("kern_s"), cat("kern_e")
    ck_s, ck_e = cat("comm_k_s"), cat("comm_k_e")
    rt.shape = "cuda" if kern_s.size or ck_s.size else "cpu"
    rt.pipeline = Intervals.union(cat("pp_s"), cat("pp_e"))
    if rt.shape == "cuda":
        rt.compute = Intervals.union(kern_s, kern_e)
        rt.comm = Intervals.union(ck_s, ck_e)
        rt.memory = Intervals.union(cat("mem_s"), cat("mem_e"))
        names = [n for s in sinks for n in s.comm_k_names]
        rt.collectives = sorted(zip(names, ck_s.tolist(), ck_e.tolist()), key=lambda x: x[1])
        rt.step_ids, rt.step_windows = _cuda_step_windows(steps, sinks, cat)
    else:
        step_tids = {st[3] for st in steps}
        cpu_s, cpu_e, cpu_tid = cat("cpu_s"), cat("cpu_e"), cat("cpu_tid")
        if step_tids:
            main = np.isin(cpu_tid, np.array([float(t) for t in step_tids if isinstance(t, (int, float))]))
            cpu_s, cpu_e = cpu_s[main], cpu_e[main]
        rt.compute = Intervals.union(cpu_s, cpu_e)
        cs, ce = cat("ccomm_s"), cat("ccomm_e")
        rt.comm = Intervals.union(cs, ce)
        names = [n for s in sinks for n in s.ccomm_names]
        rt.collectives = sorted(zip(names, cs.tolist(), ce.tolist()), key=lambda x: x[1])
        if steps:
            rt.step_ids = np.array([st[0] for st in steps], dtype=np.int64)
            rt.step_windows = np.array([[st[1], st[2]] for st in steps], dtype=np.float64)
    if not steps and (len(rt.compute) or len(rt.comm)):
        # No ProfilerStep spans: the whole trace is one step.
        every = Intervals.union_of(rt.compute, rt.comm, rt.memory)
        rt.step_ids = np.array([0], dtype=np.int64)
        rt.step_windows = np.array([[every.starts[0], every.ends[-1]]])
        rt.problems.append("no ProfilerStep# spans: the whole trace is analysed as one step")
    return rt


def _cuda_step_windows(steps: list, sinks: list[_Sink], cat: Any) -> tuple[np.ndarray, np.ndarray]:
    """Device-side step windows: from the first device event whose launch lies in the step span to
    the last one's end, or to the next window's start if that comes first."""
    dev_s = np.concatenate([cat("kern_s"), cat("comm_k_s")])
    dev_e = np.concatenate([cat("kern_e"), cat("comm_k_e")])
    dev_corr = np.concatenate([cat("kern_corr"), cat("comm_k_corr")])
    if not steps or dev_s.size == 0:
        return np.empty(0, dtype=np.int64), np.empty((0, 2))
    rt_ts, rt_corr = cat("rt_ts"), cat("rt_corr")
    order = np.argsort(rt_corr)
    rt_ts, rt_corr = rt_ts[order], rt_corr[order]
    if rt_corr.size:
        idx = np.clip(np.searchsorted(rt_corr, dev_corr), 0, rt_corr.size - 1)
        launch = np.where(rt_corr[idx] == dev_corr, rt_ts[idx], np.nan)
    else:
        launch = np.full(dev_corr.shape, np.nan)
    starts = np.array([st[1] for st in steps])
    ends = np.array([st[2] for st in steps])
    k = np.searchsorted(starts, launch, side="right") - 1
    ok = (k >= 0) & ~np.isnan(launch)
    ok[ok] &= launch[ok] < ends[k[ok]]
    ids, windows = [], []
    for j, st in enumerate(steps):
        sel = ok & (k == j)
        if sel.any():
            ids.append(st[0])
            windows.append([dev_s[sel].min(), dev_e[sel].max()])
    win = np.array(windows, dtype=np.float64).reshape(-1, 2)
    # A step's last kernels may still run when the next step's first ones start: end each window
    # where the next begins, so the windows partition device time and nothing is counted twice.
    win[:-1, 1] = np.minimum(win[:-1, 1], np.maximum(win[1:, 0], win[:-1, 0]))
    return np.array(ids, dtype=np.int64), win


def load_rank_traces(logdir: str | Sequence[str]) -> tuple[dict[int, RankTrace], list[str], list[int]]:
    """Load every rank's traces under ``logdir``: ({rank: RankTrace}, directory-level problems, missing ranks).

    Raises :class:`TraceLoadError` (a ``ValueError``) when nothing at all can be analysed.
    """
    files = list(logdir) if isinstance(logdir, (list, tuple)) else find_trace_files(logdir)
    if not files:
        raise TraceLoadError(
            f"analyze: no trace files (*trace*.json or *trace*.json.gz) under `logdir={logdir!r}`. "
            "Point it at the profiler's output directory (MFUMonitor writes to <log_dir>/profiler)."
        )
    per_rank: dict[int, tuple[list, list, list, list]] = {}
    problems: list[str] = []
    for path in files:
        sink, meta, probs = load_trace(path)
        rank = _rank_of(path, meta)
        if rank is None:
            problems.append(f"{os.path.basename(path)}: no rank in distributedInfo or file name; skipped")
            continue
        paths, sinks, metas, rprobs = per_rank.setdefault(rank, ([], [], [], []))
        paths.append(path), sinks.append(sink), metas.append(meta), rprobs.extend(probs)
    ranks = {r: _build(r, *v) for r, v in sorted(per_rank.items())}
    usable = {r: t for r, t in ranks.items() if t.step_windows.size}
    if not usable:
        detail = "; ".join(p for t in ranks.values() for p in t.problems) or "no events"
        raise TraceLoadError(f"analyze: no usable trace under `logdir={logdir!r}` ({'; '.join(problems + [detail])}).")
    for r, t in ranks.items():
        if r not in usable:
            problems.append(f"rank {r}: nothing usable ({'; '.join(t.problems) or 'no step or device events'})")
    world = max([t.world_size or 0 for t in usable.values()] + [max(usable) + 1])
    missing = [r for r in range(world) if r not in usable]
    if missing:
        problems.append(f"missing ranks {missing} of world size {world}")
    return usable, problems, missing
