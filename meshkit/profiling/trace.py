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
  worker threads) are communication. Compute is the *operator* ``cpu_op`` events on the step's
  thread (a ``namespace::name`` such as ``aten::mm`` or ``fsdp::chunk_cat``); containers that
  only dispatch (autograd nodes ``XBackward0``, ``autograd::engine::*``, DTensor's
  ``PythonSubclass`` / ``Redistribute``) and comm ops (``c10d::*``, ``_c10d_functional::*``,
  ``record_param_comms``) are not compute, so time a container spends blocked in a collective
  is not counted as compute. Explicit waits (``*wait*`` ops such as
  ``_c10d_functional::wait_tensor``) are kept as their own intervals.

Host spans that say which phase of a training step the main thread is in are kept too:
meshkit's own markers (``meshkit:forward_backward``, ``meshkit:optimizer``,
``meshkit:validation``, ``meshkit:checkpoint``, written by ``MFUMonitor``) and torch's
(``Optimizer.step#*`` / ``Optimizer.zero_grad#*``, ``enumerate(DataLoader)#*``).
Spans named ``PP:*`` are pipeline actions. Times are kept in microseconds, as Kineto writes them.

A complete event with a ``ts`` / ``dur`` that is missing, not a number or not finite, a negative
``dur`` or a non-numeric correlation (:data:`BAD_EVENT_REASONS`) is skipped, never read as 0, and
counted per file and reason (``RankTrace.bad_events``, ``problems``); :func:`load_windows` refuses a
file whose complete events are all bad, naming it.
"""

from __future__ import annotations

import gzip
import io
import itertools
import json
import math
import operator
import os
import re
import zlib
from array import array
from dataclasses import dataclass, field
from typing import Any, ClassVar, Iterator, Sequence, Union

import msgspec
import numpy as np

__all__ = ["Intervals", "RankTrace", "TraceWindow", "TraceLoadError", "PHASE_MARKERS", "BAD_EVENT_REASONS",
           "COMPUTE_CLASSES", "COMPUTE_CLASS_NAMES", "compute_class", "find_trace_files", "load_trace",
           "load_rank_trace", "load_windows"]

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

    def _contains(self, t: np.ndarray) -> np.ndarray:
        i = np.searchsorted(self.starts, t, side="right") - 1
        return (i >= 0) & (t < self.ends[np.maximum(i, 0)]) if len(self) else np.zeros(t.shape, dtype=bool)

    def _combine(self, other: "Intervals", keep: Any) -> "Intervals":
        """Elementary segments between all boundaries, kept where ``keep(in_self, in_other)``: one sweep.

        The boundaries are sorted once (4 sorted runs) with +1 / -1 per set; a segment's membership
        is each set's running count after the last boundary at its start, and runs of kept segments
        become the result's intervals (so touching kept segments are one interval, as in :meth:`union`).
        """
        pts = np.concatenate([self.starts, self.ends, other.starts, other.ends])
        if pts.size < 2:
            return Intervals(np.empty(0), np.empty(0))
        n, m = self.starts.size, other.starts.size
        step_a = np.zeros(pts.size, dtype=np.int64)
        step_a[:n], step_a[n:2 * n] = 1, -1
        step_b = np.zeros(pts.size, dtype=np.int64)
        step_b[2 * n:2 * n + m], step_b[2 * n + m:] = 1, -1
        order = np.argsort(pts, kind="stable")
        pts = pts[order]
        last = np.empty(pts.size, dtype=bool)  # the last boundary at each distinct time
        np.not_equal(pts[1:], pts[:-1], out=last[:-1])
        last[-1] = True
        at = pts[last]
        in_a = np.cumsum(step_a[order])[last][:-1] > 0
        in_b = np.cumsum(step_b[order])[last][:-1] > 0
        sel = np.asarray(keep(in_a, in_b), dtype=np.int8)  # segment k is [at[k], at[k + 1])
        edges = np.flatnonzero(np.diff(np.concatenate([[0], sel, [0]])))
        return Intervals(at[edges[0::2]], at[edges[1::2]])

    def intersect(self, other: "Intervals") -> "Intervals":
        """``self ∩ other``.

        >>> Intervals.union([0], [10]).intersect(Intervals.union([5], [20])).total
        5.0
        """
        if not len(self) or not len(other):
            return _NONE
        return self._combine(other, np.logical_and)

    def minus(self, other: "Intervals") -> "Intervals":
        """``self ∖ other``.

        >>> Intervals.union([0], [10]).minus(Intervals.union([2, 6], [4, 7])).total
        7.0
        """
        if not len(self) or not len(other):
            return self
        return self._combine(other, lambda a, b: a & ~b)

    def measure(self, lo: Any, hi: Any) -> np.ndarray:
        """Covered length inside each window ``[lo[k], hi[k])``."""
        lo = np.asarray(lo, dtype=np.float64)
        hi = np.asarray(hi, dtype=np.float64)
        if len(self) == 0:
            return np.zeros(np.broadcast(lo, hi).shape)
        return np.maximum(self._covered_before(hi) - self._covered_before(lo), 0.0)


_NONE = Intervals(np.empty(0), np.empty(0))


def intersection_measure(a: Intervals, b: Intervals, lo: Any, hi: Any) -> np.ndarray:
    """|A ∩ B| inside each window, as |A| + |B| − |A ∪ B| (inclusion–exclusion)."""
    return a.measure(lo, hi) + b.measure(lo, hi) - Intervals.union_of(a, b).measure(lo, hi)


# ------------------------------------------------------------------------------ rank trace


PHASE_MARKERS: dict[str, str] = {
    "meshkit:forward_backward": "forward_backward",
    "meshkit:optimizer": "optimizer",
    "meshkit:validation": "validation",
    "meshkit:checkpoint": "checkpoint",
    "meshkit:stop_signal": "stop_signal",
    "Optimizer.step#": "optimizer",
    "Optimizer.zero_grad#": "optimizer",
    "enumerate(DataLoader)#": "data_wait",
}
"""Host span name (prefix) -> the step phase it marks. ``meshkit:*`` spans are MFUMonitor's own
``record_function`` markers (``meshkit:stop_signal``: Lightning's per-batch stop-signal broadcast, where the
ranks wait for the slowest between batches); the others are torch's."""

_EMPTY = lambda: Intervals.union([], [])  # noqa: E731


COMPUTE_CLASSES: tuple[tuple[str, str, str], ...] = (
    # (class, CPU operator names (cpu_op), CUDA kernel names (kernel)); regular expressions, case-insensitive,
    # searched in this order: the first class that matches wins (attention before matmul: an SDPA op in
    # its math form runs bmm ops inside it, and a fused attention kernel's name may say "cutlass").
    ("attention",
     r"scaled_dot_product|flash_attention|efficient_attention|cudnn_attention|flex_attention",
     r"flash|fmha|attention|_attn_|attn_fwd|attn_bwd|sdpa"),
    ("matmul",
     r"^aten::(?:mm|addmm|bmm|baddbmm|addbmm|matmul|linear|mv|addmv|dot|vdot|einsum|_scaled_mm|_grouped_mm"
     r"|_addmm_activation|mkldnn_linear|mkldnn_matmul|linear_backward)$",
     r"gemm|gemv|cublas|cutlass|xmma|nvjet|hmma|s16816|s1688|s884|splitk|matmul|_mm_|wgmma"),
)
"""The one operator/kernel classification of compute: a compute operator (CPU traces) or compute kernel
(CUDA traces) is ``attention``, ``matmul``, or neither (``non_matmul``: norms, elementwise, softmax outside
attention, the loss, copies, meshkit's and other Triton kernels such as ``_rms_norm_fwd``). NCCL kernels
are communication, never compute (see the module doc). ``meshkit analyze``'s waterfall splits compute time
by it (docs/profiling.md lists it)."""
_CLASS_RES = tuple((name, re.compile(cpu, re.IGNORECASE), re.compile(kern, re.IGNORECASE))
                   for name, cpu, kern in COMPUTE_CLASSES)
COMPUTE_CLASS_NAMES = ("attention", "matmul", "non_matmul")


def compute_class(name: str, kernel: bool = False) -> str:
    """The class of a compute operator (``kernel=False``) or CUDA kernel by name (:data:`COMPUTE_CLASSES`).

    >>> compute_class("aten::addmm"), compute_class("aten::_scaled_dot_product_flash_attention_for_cpu")
    ('matmul', 'attention')
    >>> compute_class("sm90_xmma_gemm_bf16bf16_bf16f32", kernel=True), compute_class("_rms_norm_fwd", kernel=True)
    ('matmul', 'non_matmul')
    """
    for cls, cpu, kern in _CLASS_RES:
        if (kern if kernel else cpu).search(name):
            return cls
    return "non_matmul"


_SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaStreamWaitEvent",
               "hipStreamSynchronize", "hipDeviceSynchronize", "hipEventSynchronize")
"""CUDA/HIP runtime calls in which the host waits for the device (host_other's ``sync``)."""

_DTENSOR_OPS = re.compile(r"^(?:PythonSubclass|_FromTorchTensor|_ToTorchTensor|(?:Nested)?Redistribute)"
                          r"(?:Backward\d*)?$")
"""``cpu_op`` containers of DTensor (torch 2.13): its ``__torch_dispatch__`` (``PythonSubclass``), ``from_local`` /
``to_local`` (``_FromTorchTensor`` / ``_ToTorchTensor``), ``redistribute`` and their backward nodes: host_other's
``dtensor`` (tensor parallelism's Python; in the demo 42 ms of rank 0's 555 ms window)."""



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
    compute: Intervals = field(default_factory=_EMPTY)
    comm: Intervals = field(default_factory=_EMPTY)
    memory: Intervals = field(default_factory=_EMPTY)
    pipeline: Intervals = field(default_factory=_EMPTY)
    """Union of ``PP:*`` spans (pipeline actions), if the run recorded them."""
    waits: Intervals = field(default_factory=_EMPTY)
    """CPU: explicit comm-wait ops (``*wait*`` c10d ops) on the step's thread."""
    comm_calls: Intervals = field(default_factory=_EMPTY)
    """CPU: collective calls on the step's thread (``c10d::*`` and ``_c10d_functional::*`` ops but the waits
    and ``record_param_comms``). On a loaded host such a call outlasts its gloo span by milliseconds (a 3 ms
    ``c10d::allreduce_`` around a 0.2 ms ``gloo:all_reduce`` in the demo): the thread is in the collective's
    call, not computing, and the step model counts it as exposed comm."""
    phases: dict[str, Intervals] = field(default_factory=dict)
    """Host phase spans on the step's thread, by phase (see :data:`PHASE_MARKERS`)."""
    optimizer_kernels: Intervals = field(default_factory=_EMPTY)
    """CUDA: compute kernels launched inside an optimizer phase span."""
    compute_classes: dict[str, Intervals] = field(default_factory=dict)
    """``attention`` and ``matmul``: the compute ops (CPU) or kernels (CUDA) of that class
    (:data:`COMPUTE_CLASSES`), as unions; each lies inside ``compute`` (they may overlap each other)."""
    host_spans: dict[str, Intervals] = field(default_factory=dict)
    """Host time that explains host_other, on the step's thread: ``sync`` (runtime sync calls),
    ``fsdp_hooks`` (``FSDP::*`` spans), ``autograd_engine`` (``autograd::engine::*`` spans),
    ``op_dispatch`` (containers that only dispatch: autograd nodes ...), ``dtensor`` (DTensor's own containers:
    :data:`_DTENSOR_OPS`)."""
    comm_groups: dict[str, Intervals] = field(default_factory=dict)
    """``comm`` by process group name: NCCL kernels by the group in their args; gloo spans by the group of
    the ``record_param_comms`` ops that precede them on the main thread, one group per worker thread (a
    gloo process group runs its collectives on threads of its own), the most frequent one."""
    group_ranks: dict[str, list[int]] = field(default_factory=dict)
    """Process group name -> its global ranks, as the trace records them (``distributedInfo.pg_config``,
    the ops' and kernels' ``Process Group Ranks``)."""
    mesh_groups: dict[str, Any] | None = None
    """The mesh axes' process groups MFUMonitor wrote (``meshkit_mesh_groups``: ``{axis: {"group_name",
    "ranks"}}``)."""
    flops: dict[str, Any] | None = None
    """Model FLOPs per step of one device that MFUMonitor wrote (its trace's ``meshkit_flops`` key:
    ``{"matmul", "attention", "recompute_share", "source"}``)."""
    peak: dict[str, Any] | None = None
    """The peak FLOP/s MFUMonitor used (``{"flops", "source"}``, its trace's ``meshkit_peak`` key)."""
    host_steps: Intervals = field(default_factory=_EMPTY)
    """The ``ProfilerStep#N`` spans on the host (the same as ``step_windows`` on CPU)."""
    collectives: list[tuple[str, float, float, Any]] = field(default_factory=list)
    """(collective name, start, end, stream or thread) in start order."""
    events: int = 0
    bytes: int = 0
    problems: list[str] = field(default_factory=list)
    bad_events: list[dict[str, Any]] = field(default_factory=list)
    """Per file with skipped complete events: ``{"file", "count", "complete", "reasons", "first",
    "message"}`` (``reasons``: :data:`BAD_EVENT_REASONS` -> count; ``first``: the first one, with its
    reason; ``message``: one line saying all that, also in ``problems``)."""

    @property
    def partial(self) -> bool:
        return bool(self.problems)


@dataclass
class TraceWindow:
    """One profiler window of a run: every rank's trace of it."""

    key: int
    """The window's first batch (from MFUMonitor's ``rank{R}.{first}.pt.trace.json``), else its order."""
    ranks: dict[int, RankTrace]
    missing: list[int]


class _Args(msgspec.Struct, gc=False):
    correlation: Union[int, float, str, None] = None  # str: kept, to be flagged (_bad_reason)
    pg_name: Union[str, int, None] = msgspec.field(default=None, name="Process Group Name")
    pg_ranks: Union[str, list, None] = msgspec.field(default=None, name="Process Group Ranks")
    """``record_param_comms`` ops and NCCL kernels: the process group (its name, its ranks as "[0, 1]")."""


class _Event(msgspec.Struct, gc=False, tag_field="ph", tag="X"):
    """A complete (``"ph": "X"``) Kineto event: the fields the analysis reads; msgspec skips every
    other field unparsed."""

    ph: ClassVar[str] = "X"
    cat: str = ""
    name: str = ""
    ts: Union[float, str, None] = None  # str: kept, to be flagged
    dur: Union[float, str, None] = None
    tid: Union[int, str, None] = None
    args: Union[_Args, None] = None


_NOT_COMPLETE = "\0"
"""The category every other phase's event reports: such events are decoded with no field read."""
_OTHER_PHASES = "BEiICbneSTpFstfPNODMVvRc()"
"""The Chrome trace-event phases besides "X"; an event with another (or no) ``ph`` sends its batch
down the plain-JSON path, which reads it the same way."""


def _phase_struct(ph: str) -> type:
    return msgspec.defstruct(f"_Phase{ord(ph)}", [], gc=False, tag_field="ph", tag=ph,
                             namespace={"ph": ph, "cat": _NOT_COMPLETE})


_PHASE_STRUCTS = tuple(map(_phase_struct, _OTHER_PHASES))
_UNREAD = {ph: cls() for ph, cls in zip(_OTHER_PHASES, _PHASE_STRUCTS)}
"""An event of another phase, as the plain-JSON path reads it (one shared instance per phase)."""
_SKIP = msgspec.defstruct("_NoPhase", [], gc=False, namespace={"ph": "", "cat": _NOT_COMPLETE})()
_TS, _DUR, _NAME = (operator.attrgetter(k) for k in ("ts", "dur", "name"))
_TID, _CORR = operator.attrgetter("tid"), operator.attrgetter("args.correlation")

BAD_EVENT_REASONS = ("ts missing", "ts not a number", "ts not finite", "dur missing", "dur not a number",
                     "dur not finite", "dur negative", "correlation not a number")
"""Why a complete (``"ph": "X"``) event is skipped: Kineto writes ``ts`` / ``dur`` as finite numbers
(µs), ``dur >= 0``, and a numeric ``args.correlation``. Reading anything else as 0 would put a
table of zeros in front of the user, so such events are counted per file and reason, and skipped."""
_COMM_NS = ("c10d::", "_c10d_functional::", "record_param_comms", "gloo:", "nccl:", "PP:")
_NOT_OPS = ("autograd::", "torch::autograd::", "profiler::")
_NOT_COMPUTE = _COMM_NS + _NOT_OPS
_CAT = operator.attrgetter("cat")
_DECODE_BATCH = msgspec.json.Decoder(list[Union[(_Event, *_PHASE_STRUCTS)]]).decode  # type: ignore[valid-type]


def _phase_of(name: str) -> str | None:
    for prefix, phase in PHASE_MARKERS.items():
        if name.startswith(prefix):
            return phase
    return None


class _Loose(list):
    """A batch decoded as plain JSON: its ``ts`` / ``dur`` / correlation values are unchecked."""


def _coerce(ev: Any) -> _Event:
    """An event decoded as plain JSON (a batch that does not match the typed schema), read loosely:
    names and a float ``tid`` are tolerated; ``ts``, ``dur`` and the correlation are kept as they
    are, for :meth:`_Sink.add` to check (:func:`_bad_reason`)."""
    ph = ev.get("ph") if isinstance(ev, dict) else None
    if ph != "X":
        return _UNREAD.get(ph, _SKIP) if isinstance(ph, str) else _SKIP
    args, corr = ev.get("args"), None
    if isinstance(args, dict) and any(args.get(k) is not None for k in _ARG_KEYS):
        pg, ranks = args.get("Process Group Name"), args.get("Process Group Ranks")
        corr = _Args(args.get("correlation"), pg if isinstance(pg, (str, int)) else None,
                     ranks if isinstance(ranks, (str, list)) else None)
    tid = ev.get("tid")
    return _Event(str(ev.get("cat", "")), str(ev.get("name", "")), ev.get("ts"), ev.get("dur"),
                  tid if isinstance(tid, (int, str)) else None, corr)


_ARG_KEYS = ("correlation", "Process Group Name", "Process Group Ranks")


def _times(xs: list[_Event]) -> tuple[np.ndarray, np.ndarray] | None:
    """Start and end (``ts + dur``) of the complete events of a *typed* batch, one pass in C per field,
    or None when one is missing, not a number or ``dur < 0`` (``array("d")`` refuses None and strings;
    msgspec already refused what is not finite): then each event is checked (:func:`_bad_reason`)."""
    try:
        ts = np.frombuffer(array("d", map(_TS, xs)), dtype=np.float64)
        dur = np.frombuffer(array("d", map(_DUR, xs)), dtype=np.float64)
    except TypeError:
        return None
    return None if len(dur) and dur.min() < 0 else (ts, ts + dur)


def _bad_reason(ev: _Event) -> str | None:
    """Why a complete event cannot be used (one of :data:`BAD_EVENT_REASONS`), or None."""
    for key, v in (("ts", ev.ts), ("dur", ev.dur)):
        if v is None:
            return f"{key} missing"
        if type(v) not in (int, float):  # a string, a bool, a list ...
            return f"{key} not a number"
        if not _finite(v):
            return f"{key} not finite"
    if ev.dur < 0:  # type: ignore[operator]
        return "dur negative"
    corr = ev.args.correlation if ev.args is not None else None
    if corr is not None and (type(corr) not in (int, float) or not _finite(corr)):
        return "correlation not a number"
    return None


def _finite(v: float) -> bool:
    """Whether a number is a finite double (an integer too large for one is not)."""
    try:
        return math.isfinite(v)
    except OverflowError:
        return False


def _show(ev: _Event) -> str:
    fields = {"ph": ev.ph, "cat": ev.cat, "name": ev.name, "ts": ev.ts, "dur": ev.dur}
    if ev.args is not None and ev.args.correlation is not None:
        fields["correlation"] = ev.args.correlation
    text = json.dumps(fields, default=repr)
    return text if len(text) <= 200 else text[:197] + "..."


def _bad_summary(file: str, sink: "_Sink") -> str:
    """One line: the file, how many complete events were skipped, by reason, and the first one."""
    n = sum(sink.bad.values())
    reasons = ", ".join(f"{c} {r}" for r, c in sorted(sink.bad.items(), key=lambda x: (-x[1], x[0])))
    return (f"{file}: skipped {n} of {n + sink.complete} complete events as bad ({reasons}); "
            f"first: {sink.bad_first}")


class _Sink:
    """Per-file accumulator: classify each event as it streams past."""

    def __init__(self) -> None:
        f = lambda: array("d")  # noqa: E731
        self.kern_s, self.kern_e, self.kern_corr = f(), f(), f()
        self.comm_k_s, self.comm_k_e, self.comm_k_corr, self.comm_k_stream = f(), f(), f(), f()
        self.comm_k_names: list[str] = []
        self.mem_s, self.mem_e = f(), f()
        self.rt_ts, self.rt_corr = f(), f()
        self.cpu_s, self.cpu_e, self.cpu_tid = f(), f(), f()
        self.wait_s, self.wait_e, self.wait_tid = f(), f(), f()
        self.call_s, self.call_e, self.call_tid = f(), f(), f()
        self.autograd_e = f()
        self.mm_s, self.mm_e, self.mm_tid, self.at_s, self.at_e, self.at_tid = f(), f(), f(), f(), f(), f()
        self.eng_s, self.eng_e, self.eng_tid, self.disp_s, self.disp_e, self.disp_tid = f(), f(), f(), f(), f(), f()
        self.dt_s, self.dt_e, self.dt_tid = f(), f(), f()
        self.kmm_s, self.kmm_e, self.kat_s, self.kat_e = f(), f(), f(), f()
        self.sync_s, self.sync_e = f(), f()
        self.comm_k_pg: list[str | None] = []
        """Per NCCL kernel: its process group's name (None: not recorded)."""
        self.pg_calls: list[tuple[float, float | None, str]] = []
        """``record_param_comms`` ops: (start, thread, process group name)."""
        self.pg_ranks: dict[str, list[int]] = {}
        """Process group name -> its ranks, as the trace records them."""
        self.hook_s, self.hook_e, self.hook_tid = f(), f(), f()
        self.ccomm_s, self.ccomm_e, self.ccomm_tid = f(), f(), f()
        self.ccomm_names: list[str] = []
        self.pp_s, self.pp_e = f(), f()
        self.phases: list[tuple[str, float, float, float | None, bool]] = []
        self.steps: list[tuple[int, float, float, float | None]] = []
        """(step, start, end, thread id or None: :func:`_thread`), as for ``phases`` after the phase."""
        self.events = 0
        self.complete = 0
        """Complete ("X") events kept (every one checked, see :func:`_bad_reason`)."""
        self.bad: dict[str, int] = {}
        """Skipped complete events by reason (:data:`BAD_EVENT_REASONS`)."""
        self.bad_first: str | None = None
        self._cpu_op_kind = _Memo(_cpu_op_kind)
        self._cat_code = _Memo(_cat_code)
        self._collective = _Memo(_kernel_collective)
        self._kernel_code = _Memo(_kernel_code)
        self._sync = _Memo(lambda name: name.startswith(_SYNC_CALLS))

    @property
    def first_ts(self) -> float:
        """The earliest start of a kept event (orders a rank's windows when their names do not)."""
        firsts = [min(a) for a in (self.cpu_s, self.kern_s, self.comm_k_s, self.ccomm_s) if len(a)]
        firsts += [st[1] for st in self.steps[:1]]
        return min(firsts, default=math.inf)

    def add(self, batch: list[_Event]) -> None:
        """Classify a batch: complete ("X") events grouped by category, each group in bulk.

        One pass reads each event's category code (:data:`_KEPT_CATS` in order, then other complete
        events, then the other phases); a stable argsort groups the complete events by it, in file
        order within a group. Every complete event's start and end are read once into numpy arrays
        (``ts + dur``: the same double addition as per event), and a group is a slice of them.
        """
        self.events += len(batch)
        codes = np.fromiter(map(self._cat_code.__getitem__, map(_CAT, batch)), dtype=np.int8, count=len(batch))
        order = np.argsort(codes, kind="stable")
        order = order[:len(order) - int(np.count_nonzero(codes == _NOT_X))]
        xs = list(map(batch.__getitem__, order.tolist()))
        bounds = _bounds(codes[order])
        times = None if isinstance(batch, _Loose) else _times(xs)
        corrs = None if times is None else _correlations(xs, bounds)
        if times is None or corrs is None:  # check each complete event, in category then file order; regroup
            xs = self._drop_bad(sorted(xs, key=_CAT))
            xs.sort(key=lambda ev: self._cat_code[ev.cat])
            bounds = _bounds(np.array([self._cat_code[ev.cat] for ev in xs], dtype=np.int8))
            times, corrs = _times(xs), _correlations(xs, bounds)  # every event left passed _bad_reason
        self.complete += len(xs)
        ts, te = times  # type: ignore[misc]
        for code, cat in enumerate(_KEPT_CATS):
            lo, hi = int(bounds[code]), int(bounds[code + 1])
            if lo == hi:
                continue
            evs, start, end = xs[lo:hi], ts[lo:hi], te[lo:hi]
            if cat in ("cpu_op", "user_annotation", "python_function"):
                self._host(cat, evs, start, end)
            elif cat == "kernel":
                self._kernels(evs, start, end, corrs[code])  # type: ignore[index]
            elif cat in ("gpu_memcpy", "gpu_memset"):
                _put(self.mem_s, start), _put(self.mem_e, end)
            else:  # cuda_runtime, cuda_driver, hip_runtime: a launch without a correlation cannot be matched
                corr = corrs[code]  # type: ignore[index]
                has = ~np.isnan(corr)
                _put(self.rt_ts, start[has]), _put(self.rt_corr, corr[has])
                sync = np.fromiter(map(self._sync.__getitem__, map(_NAME, evs)), dtype=bool, count=len(evs))
                if sync.any():
                    _put(self.sync_s, start[sync]), _put(self.sync_e, end[sync])

    def _kernels(self, evs: list[_Event], start: np.ndarray, end: np.ndarray, corr: np.ndarray) -> None:
        # one pass over the names: NCCL (communication) or a compute class (COMPUTE_CLASSES)
        code = np.fromiter(map(self._kernel_code.__getitem__, map(_NAME, evs)), dtype=np.int8, count=len(evs))
        is_nccl = code == _NCCL
        corr = np.where(np.isnan(corr), -1.0, corr)  # no correlation: no launch to match
        if is_nccl.any():
            nccl = list(itertools.compress(evs, is_nccl))
            _put(self.comm_k_s, start[is_nccl]), _put(self.comm_k_e, end[is_nccl])
            _put(self.comm_k_corr, corr[is_nccl])
            self.comm_k_stream.extend(_floats(nccl, _TID, _tid))
            self.comm_k_names.extend(map(self._collective.__getitem__, map(_NAME, nccl)))
            self.comm_k_pg.extend(map(self._group, nccl))
            is_compute = ~is_nccl
            start, end, corr, code = start[is_compute], end[is_compute], corr[is_compute], code[is_compute]
        _put(self.kern_s, start), _put(self.kern_e, end), _put(self.kern_corr, corr)
        for cls, s_, e_ in ((_MATMUL, self.kmm_s, self.kmm_e), (_ATTENTION, self.kat_s, self.kat_e)):
            sel = code == cls
            if sel.any():
                _put(s_, start[sel]), _put(e_, end[sel])

    def _group(self, ev: _Event) -> str | None:
        """An event's process group name (and its ranks, once per group), as recorded in its args."""
        a = ev.args
        if a is None or a.pg_name is None:
            return None
        name = str(a.pg_name)
        if name not in self.pg_ranks and a.pg_ranks is not None:
            ranks = _ranks(a.pg_ranks)
            if ranks is not None:
                self.pg_ranks[name] = ranks
        return name

    def _drop_bad(self, xs: list[_Event]) -> list[_Event]:
        good = []
        for ev in xs:
            reason = _bad_reason(ev)
            if reason is None:
                good.append(ev)
                continue
            self.bad[reason] = self.bad.get(reason, 0) + 1
            if self.bad_first is None:
                self.bad_first = f"{reason}: {_show(ev)}"
        return good

    def _host(self, cat: str, evs: list[_Event], start: np.ndarray, end: np.ndarray) -> None:
        if cat == "cpu_op":  # compute: operators; waits: explicit c10d wait ops (aten:: first: most ops)
            kind = np.fromiter(map(self._cpu_op_kind.__getitem__, map(_NAME, evs)), dtype=np.int8, count=len(evs))
            # (the spans only feed unions: their order is free)
            is_op, is_wait = (kind >= _OP) & (kind <= _OP_ATTENTION), kind == _WAIT
            _put(self.cpu_s, start[is_op]), _put(self.cpu_e, end[is_op])
            tid = np.frombuffer(_floats(evs, _TID, _tid), dtype=np.float64)
            _put(self.cpu_tid, tid[is_op])
            _put(self.wait_s, start[is_wait]), _put(self.wait_e, end[is_wait]), _put(self.wait_tid, tid[is_wait])
            for code, cols in ((_OP_MATMUL, (self.mm_s, self.mm_e, self.mm_tid)),
                               (_OP_ATTENTION, (self.at_s, self.at_e, self.at_tid)),
                               (_ENGINE, (self.eng_s, self.eng_e, self.eng_tid)),
                               (_DISPATCH, (self.disp_s, self.disp_e, self.disp_tid)),
                               (_DTENSOR, (self.dt_s, self.dt_e, self.dt_tid)),
                               (_COMM_CALL, (self.call_s, self.call_e, self.call_tid))):
                sel = kind == code
                if sel.any():
                    _put(cols[0], start[sel]), _put(cols[1], end[sel]), _put(cols[2], tid[sel])
            _put(self.autograd_e, end[kind == _ENGINE])
            for i in np.flatnonzero(kind == _PARAM_COMMS).tolist():  # few: one per collective
                name = self._group(evs[i])
                if name is not None:
                    self.pg_calls.append((float(start[i]), _thread(evs[i].tid), name))
            return
        for ev in evs:  # comm, pipeline and phase spans: few
            name = ev.name
            if name.startswith(("gloo:", "nccl:")):
                self.ccomm_s.append(ev.ts), self.ccomm_e.append(ev.ts + ev.dur)
                self.ccomm_tid.append(_tid(ev)), self.ccomm_names.append(name)
            elif name.startswith("PP:"):
                self.pp_s.append(ev.ts), self.pp_e.append(ev.ts + ev.dur)
            elif name.startswith("FSDP::"):
                self.hook_s.append(ev.ts), self.hook_e.append(ev.ts + ev.dur), self.hook_tid.append(_tid(ev))
            elif (phase := _phase_of(name)) is not None:
                self.phases.append((phase, ev.ts, ev.ts + ev.dur, _thread(ev.tid), name.startswith("meshkit:")))
            elif cat == "user_annotation" and name.startswith("ProfilerStep#") and name[13:].isdigit():
                self.steps.append((int(name[13:]), ev.ts, ev.ts + ev.dur, _thread(ev.tid)))


_COMM_CALL, _OP, _OP_MATMUL, _OP_ATTENTION, _WAIT, _ENGINE, _DISPATCH, _PARAM_COMMS = 0, 1, 2, 3, 4, 5, 6, 7
_DTENSOR = 8
"""A ``cpu_op``'s kind: a collective call (``c10d::allreduce_``, ``_c10d_functional::all_reduce`` ...), an
operator (other, matmul, attention: :data:`COMPUTE_CLASSES`; the three are compute), an explicit comm wait,
the autograd engine, a container that only dispatches (DTensor's own: :data:`_DTENSOR_OPS`)."""
_MATMUL, _ATTENTION, _NCCL = 1, 2, 3
"""A kernel's codes: compute classes (0: non_matmul), NCCL."""
_KEPT_CATS = ("cpu_op", "cuda_driver", "cuda_runtime", "gpu_memcpy", "gpu_memset", "hip_runtime", "kernel",
              "python_function", "user_annotation")
"""The categories of complete events the analysis reads, in sorted order (the order they are added in)."""
_OTHER_X, _NOT_X = len(_KEPT_CATS), len(_KEPT_CATS) + 1


_CORR_CODES = tuple(_KEPT_CATS.index(c) for c in ("cuda_driver", "cuda_runtime", "hip_runtime", "kernel"))
"""The groups whose correlation ids are read (launches and kernels)."""


def _bounds(codes: np.ndarray) -> np.ndarray:
    """Where each of :data:`_KEPT_CATS`' groups starts in the sorted codes of the complete events (and
    where the last ends)."""
    return np.searchsorted(codes, np.arange(len(_KEPT_CATS) + 1), side="left")


def _correlations(xs: list[_Event], bounds: np.ndarray) -> dict[int, np.ndarray] | None:
    """Per launch or kernel group (``bounds``: :func:`_bounds`): each event's correlation id as a double
    (NaN: none), one pass in C; None when one is not a number or too large for a double (then each event
    is checked)."""
    out = {}
    for code in _CORR_CODES:
        lo, hi = int(bounds[code]), int(bounds[code + 1])
        if lo == hi:
            continue
        try:
            out[code] = np.frombuffer(array("d", map(_CORR, xs[lo:hi])), dtype=np.float64)
        except (AttributeError, TypeError, OverflowError):  # some have none (or a bad one): per event
            vals = [ev.args.correlation if ev.args is not None else None for ev in xs[lo:hi]]
            if not all(v is None or (type(v) in (int, float) and _finite(v)) for v in vals):
                return None
            out[code] = np.array([math.nan if v is None else float(v) for v in vals], dtype=np.float64)
    return out


def _cat_code(cat: str) -> int:
    """A category's group: its index in :data:`_KEPT_CATS`, ``_OTHER_X`` for another complete event's
    (checked and counted, not read), ``_NOT_X`` for an event of another phase (:data:`_NOT_COMPLETE`)."""
    if cat == _NOT_COMPLETE:
        return _NOT_X
    return _KEPT_CATS.index(cat) if cat in _KEPT_CATS else _OTHER_X


def _cpu_op_kind(name: str) -> int:
    """A ``cpu_op``: an operator (compute, ``aten::`` first: most ops; by class), an explicit comm wait,
    the autograd engine (its ends split torch's optimizer spans), a container that only dispatches
    (autograd nodes, DTensor's), or 0 (comm ops)."""
    if name.startswith("aten::") or ("::" in name and not name.startswith(_NOT_COMPUTE)):
        cls = compute_class(name)
        return _OP_MATMUL if cls == "matmul" else _OP_ATTENTION if cls == "attention" else _OP
    if "wait" in name and name.startswith(_COMM_NS):
        return _WAIT
    if name.startswith("autograd::engine"):
        return _ENGINE
    if name == "record_param_comms":
        return _PARAM_COMMS
    if name.startswith(_COMM_NS):
        return _COMM_CALL
    return _DTENSOR if _DTENSOR_OPS.match(name) else _DISPATCH


def _ranks(value: Any) -> list[int] | None:
    """A process group's ranks as Kineto writes them ("[0, 1]", or a list), None if unreadable."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return None
    if isinstance(value, list) and all(isinstance(r, int) and not isinstance(r, bool) for r in value):
        return list(value)
    return None


def _kernel_code(name: str) -> int:
    """A device kernel: ``_NCCL`` (communication), else its compute class's code (0: non_matmul)."""
    if _kernel_collective(name) is not None:
        return _NCCL
    cls = compute_class(name, kernel=True)
    return _MATMUL if cls == "matmul" else _ATTENTION if cls == "attention" else 0


def _kernel_collective(name: str) -> str | None:
    """A device kernel's NCCL collective (``AllReduce``; the whole name if unparsed), None for compute."""
    if "nccl" not in name.lower():
        return None
    m = _NCCL_COLL.search(name)
    return m.group(1) if m else name


class _Memo(dict):
    """``memo[name]`` is ``fn(name)``, computed once per distinct name (names repeat: a trace has
    few distinct op and kernel names)."""

    def __init__(self, fn: Any) -> None:
        super().__init__()
        self._fn = fn

    def __missing__(self, name: str) -> Any:
        value = self[name] = self._fn(name)
        return value


def _put(col: array, values: np.ndarray) -> None:
    """Append a contiguous float64 array to an ``array("d")`` column (one copy of its bytes)."""
    col.frombytes(memoryview(values).cast("B"))


def _thread(tid: Any) -> float | None:
    """A thread id as the double it is compared as; None when it is not an integer a double holds."""
    return float(tid) if isinstance(tid, int) and _finite(tid) else None


def _tid(ev: _Event) -> float:
    tid = _thread(ev.tid)
    return -1.0 if tid is None else tid


def _floats(evs: list[_Event], get: Any, slow: Any) -> array:
    """``slow(ev)`` of each event as doubles, in one pass in C through ``get`` (an attrgetter) when every
    value is a number; ``slow`` (the same value, with a default for a missing one) per event otherwise."""
    try:
        return array("d", map(get, evs))
    except (AttributeError, TypeError, OverflowError):
        return array("d", map(slow, evs))



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


def _decode_loose(data: bytes) -> list | None:
    """Plain JSON: msgspec, else the stdlib (which reads what msgspec refuses: 1e400, NaN, Infinity)."""
    try:
        return msgspec.json.decode(data)
    except msgspec.DecodeError:
        pass
    try:
        return json.loads(data)
    except ValueError:
        return None


def _stream_events(reader: io.BufferedIOBase, meta: dict) -> Iterator[list[_Event]]:
    """Yield the elements of the top-level ``traceEvents`` array in batches, reading CHUNK_BYTES at a time.

    Kineto's layout is cut into batches of whole events after its ``"\\n  },"`` separator, and each
    batch is decoded by msgspec straight into :class:`_Event` (unread fields are skipped, not
    built). A batch whose values do not fit the schema is decoded as plain JSON and read loosely;
    any other layout falls back to one stdlib ``raw_decode`` per event. Top-level keys before and
    after the array are parsed into ``meta``.
    """
    # buf[start:end] holds the bytes read and not consumed; chunks are read into buf in place (no
    # new bytes object and copy per chunk), the unread tail moved to the front when it would not fit.
    buf, start, end, eof = bytearray(2 * CHUNK_BYTES), 0, 0, False

    def more() -> bool:
        nonlocal buf, start, end, eof
        if eof:
            return False
        if end + CHUNK_BYTES > len(buf):
            buf[:end - start] = buf[start:end]
            start, end = 0, end - start
            if end + CHUNK_BYTES > len(buf):  # an event longer than the buffer: grow it
                buf.extend(bytes(end + CHUNK_BYTES - len(buf)))
        with memoryview(buf) as whole, whole[end:end + CHUNK_BYTES] as room:
            n = reader.readinto(room)
        eof = not n
        end += n or 0
        return bool(n)

    while True:  # header: everything up to '"traceEvents"' and its '['
        i = buf.find(b'"traceEvents"', 0, end)
        j = buf.find(b"[", i, end) if i >= 0 else -1
        if j >= 0:
            break
        if not more():
            raise _Truncated("the file is empty" if not bytes(buf[:end]).strip() else
                             "no `traceEvents` array (not a torch.profiler trace?)")
    head = bytes(buf[:i]).rstrip().rstrip(b",")
    try:
        meta.update(json.loads(head + b"}") if head.strip() != b"{" else {})
    except ValueError:
        pass
    # From here buf[start] is the byte before the next batch (the array's '[' or the last separator's
    # ','): a batch is decoded in place, as buf[start] = '[' ... its last separator's ',' = ']', with
    # no copy of its bytes. Lengths are counted without that byte.
    start = j
    while True:
        cut = buf.rfind(_SEP, start, end)
        while cut < 0 and end - start - 1 < 4 * CHUNK_BYTES and more():
            cut = buf.rfind(_SEP, start, end)
        if cut < 0:
            break  # the last event, or not Kineto's layout: the slow path reads the rest
        buf[start], buf[cut + 4] = 0x5B, 0x5D  # '[', ']'
        with memoryview(buf) as whole, whole[start:cut + 5] as view:
            try:
                batch = _DECODE_BATCH(view)
            except msgspec.DecodeError:  # values off the schema (ValidationError), NaN, or not Kineto's layout
                raw = _decode_loose(bytes(view))
                batch = None if raw is None else _Loose(_coerce(ev) for ev in raw)
        if batch is None:
            buf[cut + 4] = 0x2C  # ',': not Kineto's layout after all; the slow path reads it as written
            break
        meta["_batches"] = meta.get("_batches", 0) + 1
        yield batch
        start = cut + 4
        if end - start - 1 < CHUNK_BYTES:
            more()
    text = io.TextIOWrapper(io.BufferedReader(_Prefixed(bytes(buf[start + 1:end]), reader)), encoding="utf-8",
                            errors="replace")
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
        yield _Loose([_coerce(ev)])
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
    and a problem string saying why (the caller flags the rank as partial); so do complete events
    with a bad ``ts`` / ``dur`` / correlation (:data:`BAD_EVENT_REASONS`), which are skipped and
    counted in ``sink.bad``.
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
    if sink.bad:
        problems.insert(0, _bad_summary(os.path.basename(path), sink))
    return sink, meta, problems


def _require_usable(path: str, rank: int | None, sink: _Sink) -> None:
    """A file whose complete events are all bad is a writer's bug, not a partial trace: refuse it."""
    if sink.bad and not sink.complete:
        raise TraceLoadError(
            f"analyze: the trace of rank {'?' if rank is None else rank}, `{path}`, has no usable events: "
            f"{_bad_summary(os.path.basename(path), sink)}. Kineto writes `ts` and `dur` as numbers of µs "
            "with dur >= 0; fix the program that wrote this file, or move it out of the directory to analyse "
            "the other ranks."
        )


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
    rt.bad_events = [{"file": os.path.basename(p), "count": sum(s.bad.values()), "complete": s.complete + sum(
        s.bad.values()), "reasons": dict(sorted(s.bad.items())), "first": s.bad_first,
        "message": _bad_summary(os.path.basename(p), s)} for p, s in zip(paths, sinks)
        if s.bad]
    rt.bytes = sum(os.path.getsize(p) for p in paths if os.path.exists(p))
    for meta in metas:
        info = meta.get("distributedInfo") or {}
        if isinstance(info.get("world_size"), int):
            rt.world_size = info["world_size"]
        pgs = info.get("pg_config")
        for pg in pgs if isinstance(pgs, list) else []:
            ranks = _ranks(pg.get("ranks")) if isinstance(pg, dict) else None
            if ranks is not None and pg.get("pg_name") is not None:  # torch's list of the process groups
                rt.group_ranks.setdefault(str(pg["pg_name"]), ranks)
        rt.host = meta.get("host_name", rt.host)
        if isinstance(meta.get("meshkit_peak"), dict):
            rt.peak = meta["meshkit_peak"]
        if isinstance(meta.get("meshkit_flops"), dict):
            rt.flops = meta["meshkit_flops"]
        if isinstance(meta.get("meshkit_mesh_groups"), dict):
            rt.mesh_groups = meta["meshkit_mesh_groups"]
    for sk in sinks:
        for name, ranks in sk.pg_ranks.items():
            rt.group_ranks.setdefault(name, ranks)
    cat = lambda name: np.concatenate([_arr(getattr(s, name)) for s in sinks]) if sinks else np.empty(0)  # noqa
    steps = sorted({st[0]: st for s in sinks for st in s.steps}.values())
    main = np.array(sorted({st[3] for st in steps if st[3] is not None}))
    # (tid == each main thread id): np.isin's first call imports numpy.ma (40 ms of CPU); main holds 1-2 ids
    on_main = (lambda tid: (tid[:, None] == main).any(axis=1)) if main.size else (
        lambda tid: np.ones(tid.shape, dtype=bool))
    kern_s, kern_e = cat("kern_s"), cat("kern_e")
    ck_s, ck_e = cat("comm_k_s"), cat("comm_k_e")
    rt.shape = "cuda" if kern_s.size or ck_s.size else "cpu"
    rt.pipeline = Intervals.union(cat("pp_s"), cat("pp_e"))
    by_phase: dict[str, tuple[list, list]] = {}
    for s in sinks:
        for phase, start, end, tid, mk in s.phases:
            if not main.size or (tid is not None and tid in main):
                for key in (phase, "meshkit:optimizer") if (phase == "optimizer" and mk) else (phase,):
                    by_phase.setdefault(key, ([], []))[0].append(start), by_phase[key][1].append(end)
    if "forward_backward" in by_phase:  # meshkit's markers: torch's optimizer spans may wrap the closure
        by_phase["optimizer"] = by_phase.pop("meshkit:optimizer", ([], []))
    else:
        by_phase.pop("meshkit:optimizer", None)
        if "optimizer" in by_phase:
            by_phase["optimizer"] = _after_backward(*by_phase["optimizer"], np.sort(cat("autograd_e")))
    rt.phases = {k: Intervals.union(v[0], v[1]) for k, v in by_phase.items()}
    rt.host_steps = Intervals.union([st[1] for st in steps], [st[2] for st in steps])
    main_only = lambda name: on_main(cat(name + "_tid"))  # noqa: E731
    spans = {"dtensor": "dt", "fsdp_hooks": "hook", "autograd_engine": "eng", "op_dispatch": "disp"}
    rt.host_spans = {part: Intervals.union(cat(k + "_s")[main_only(k)], cat(k + "_e")[main_only(k)])
                     for part, k in spans.items()}
    rt.host_spans = {"sync": Intervals.union(cat("sync_s"), cat("sync_e")), **rt.host_spans}
    if rt.shape == "cuda":
        rt.compute = Intervals.union(kern_s, kern_e)
        rt.comm = Intervals.union(ck_s, ck_e)
        rt.memory = Intervals.union(cat("mem_s"), cat("mem_e"))
        names = [n for s in sinks for n in s.comm_k_names]
        rt.collectives = sorted(zip(names, ck_s.tolist(), ck_e.tolist(), cat("comm_k_stream").tolist()),
                                key=lambda x: x[1])
        groups = [g for s in sinks for g in s.comm_k_pg]
        calls = sorted(c for s in sinks for c in s.pg_calls if not main.size or c[1] in main)
        if calls and None in groups:  # no group in a kernel's args: the record_param_comms before its launch
            launch = np.nan_to_num(_launch_times(sinks, cat, cat("comm_k_corr")), nan=-np.inf)
            k = np.searchsorted(np.array([c[0] for c in calls]), launch, side="right") - 1
            groups = [g if g is not None or i < 0 else calls[i][2] for g, i in zip(groups, k.tolist())]
        rt.comm_groups = _by_group(groups, ck_s, ck_e)
        launch = _launch_times(sinks, cat, cat("kern_corr"))
        opt = rt.phases.get("optimizer")
        if opt is not None and len(opt):
            sel = ~np.isnan(launch) & opt._contains(np.nan_to_num(launch, nan=-np.inf))
            rt.optimizer_kernels = Intervals.union(kern_s[sel], kern_e[sel])
        rt.step_ids, rt.step_windows = _cuda_step_windows(steps, sinks, cat)
        rt.compute_classes = {"attention": Intervals.union(cat("kat_s"), cat("kat_e")),
                              "matmul": Intervals.union(cat("kmm_s"), cat("kmm_e"))}
    else:
        cpu_s, cpu_e, cpu_tid = cat("cpu_s"), cat("cpu_e"), cat("cpu_tid")
        keep = on_main(cpu_tid)
        rt.compute = Intervals.union(cpu_s[keep], cpu_e[keep])
        rt.compute_classes = {name: Intervals.union(cat(k + "_s")[main_only(k)], cat(k + "_e")[main_only(k)])
                              for name, k in (("attention", "at"), ("matmul", "mm"))}
        keep = on_main(cat("wait_tid"))
        rt.waits = Intervals.union(cat("wait_s")[keep], cat("wait_e")[keep])
        keep = main_only("call")
        rt.comm_calls = Intervals.union(cat("call_s")[keep], cat("call_e")[keep])
        cs, ce = cat("ccomm_s"), cat("ccomm_e")
        rt.comm = Intervals.union(cs, ce)
        names = [n for s in sinks for n in s.ccomm_names]
        rt.collectives = sorted(zip(names, cs.tolist(), ce.tolist(), cat("ccomm_tid").tolist()), key=lambda x: x[1])
        calls = sorted(c for s in sinks for c in s.pg_calls if not main.size or c[1] in main)
        rt.comm_groups = _by_group(_gloo_groups(calls, cs, cat("ccomm_tid")), cs, ce)
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


def _by_group(groups: list, starts: np.ndarray, ends: np.ndarray) -> dict[str, Intervals]:
    """Comm spans by process group name (spans with no known group are left out)."""
    out: dict[str, tuple[list, list]] = {}
    for g, s, e in zip(groups, starts.tolist(), ends.tolist()):
        if g is not None:
            out.setdefault(g, ([], []))[0].append(s), out[g][1].append(e)
    return {g: Intervals.union(s, e) for g, (s, e) in out.items()}


def _gloo_groups(calls: list[tuple[float, Any, str]], starts: np.ndarray, tids: np.ndarray) -> list:
    """Each gloo span's process group. The spans, in start order, take the ``record_param_comms`` calls
    that started before them first in, first out (collectives enqueued back to back start in that order);
    then each worker thread gets its most frequent group (a gloo group runs its collectives on threads
    of its own), which outvotes a span that took another group's call. None: no call before any span."""
    if not calls or not starts.size:
        return [None] * int(starts.size)
    taken: dict[float, dict[str, int]] = {}
    pending: list[str] = []
    i = 0
    tid_list = tids.tolist()
    for k in np.argsort(starts, kind="stable").tolist():
        while i < len(calls) and calls[i][0] <= starts[k]:
            pending.append(calls[i][2])
            i += 1
        if pending:
            v = taken.setdefault(tid_list[k], {})
            g = pending.pop(0)
            v[g] = v.get(g, 0) + 1
    best = {tid: max(v, key=lambda g: (v[g], g)) for tid, v in taken.items()}
    return [best.get(tid) for tid in tid_list]


def _after_backward(starts: list, ends: list, autograd_ends: np.ndarray) -> tuple[list, list]:
    """Lightning runs the training closure (forward and backward) inside ``optimizer.step``: without
    meshkit's markers an ``Optimizer.step#`` span's optimizer part starts after its last backward op."""
    out_s = []
    for s, e in zip(starts, ends):
        i = np.searchsorted(autograd_ends, e, side="right") - 1
        out_s.append(max(s, float(autograd_ends[i])) if i >= 0 and autograd_ends[i] > s else s)
    return out_s, list(ends)


def _launch_times(sinks: list[_Sink], cat: Any, corr: np.ndarray) -> np.ndarray:
    """Host launch time of each device event (by CUDA correlation id); NaN where unknown."""
    rt_ts, rt_corr = cat("rt_ts"), cat("rt_corr")
    if not rt_corr.size:
        return np.full(corr.shape, np.nan)
    order = np.argsort(rt_corr)
    rt_ts, rt_corr = rt_ts[order], rt_corr[order]
    idx = np.clip(np.searchsorted(rt_corr, corr), 0, rt_corr.size - 1)
    return np.where(rt_corr[idx] == corr, rt_ts[idx], np.nan)


def _cuda_step_windows(steps: list, sinks: list[_Sink], cat: Any) -> tuple[np.ndarray, np.ndarray]:
    """Device-side step windows: from the first device event whose launch lies in the step span to
    the next window's start (the last window: to its last device event's end), so that the windows
    partition device time, idle between steps included, and nothing is counted twice."""
    dev_s = np.concatenate([cat("kern_s"), cat("comm_k_s")])
    dev_e = np.concatenate([cat("kern_e"), cat("comm_k_e")])
    dev_corr = np.concatenate([cat("kern_corr"), cat("comm_k_corr")])
    if not steps or dev_s.size == 0:
        return np.empty(0, dtype=np.int64), np.empty((0, 2))
    launch = _launch_times(sinks, cat, dev_corr)
    starts = np.array([st[1] for st in steps])
    ends = np.array([st[2] for st in steps])
    k = np.searchsorted(starts, launch, side="right") - 1
    ok = (k >= 0) & ~np.isnan(launch)
    ok[ok] &= launch[ok] < ends[k[ok]]
    # per step with device events: the first start and last end (one sort, not one pass per step)
    kk = k[ok]
    order = np.argsort(kk, kind="stable")
    kk = kk[order]
    first = np.flatnonzero(np.diff(kk, prepend=-1))  # each step's first event (k >= 0)
    ids = np.array([st[0] for st in steps], dtype=np.int64)[kk[first]]
    win = np.empty((first.size, 2))
    if first.size:
        win[:, 0] = np.minimum.reduceat(dev_s[ok][order], first)
        win[:, 1] = np.maximum.reduceat(dev_e[ok][order], first)
    # A step's last kernels may still run when the next step's first ones start, and the device may
    # idle between steps: each window ends where the next begins.
    win[:-1, 1] = np.maximum(win[1:, 0], win[:-1, 0])
    return ids, win


def load_rank_trace(paths: str | Sequence[str], rank: int | None = None) -> RankTrace:
    """Load one rank's trace file(s) of one profiler window into a :class:`RankTrace`.

    ``rank`` defaults to the file's ``distributedInfo.rank`` (else ``rank<N>`` in its name, else 0).
    Never raises for bad content: what could be read is kept and ``problems`` says why.

    >>> rt = load_rank_trace("rank0.5.pt.trace.json")  # doctest: +SKIP
    >>> rt.step_windows.shape  # doctest: +SKIP
    (2, 2)
    """
    paths = [paths] if isinstance(paths, str) else list(paths)
    sinks, metas, problems = [], [], []
    for path in paths:
        sink, meta, probs = load_trace(path)
        sinks.append(sink), metas.append(meta), problems.extend(probs)
    if rank is None:
        rank = next((r for r in (_rank_of(p, m) for p, m in zip(paths, metas)) if r is not None), 0)
    return _build(rank, paths, sinks, metas, problems)


_WINDOW_IN_NAME = re.compile(r"rank[_-]?\d+\.(\d+)\.pt\.trace", re.IGNORECASE)


def load_windows(logdir: str | Sequence[str]) -> tuple[list[TraceWindow], list[str]]:
    """Load every profiler window of a run: ([TraceWindow], directory-level problems).

    Each file is one rank's trace of one window. A rank's files are ordered by the first batch in
    MFUMonitor's name ``rank{R}.{first_batch}.pt.trace.json`` (else by their first event); the
    k-th file of every rank is window k, keyed by that first batch (else by k). Raises
    :class:`TraceLoadError` (a ``ValueError``) when nothing at all can be analysed, or when a file's
    complete events are all bad (:data:`BAD_EVENT_REASONS`; naming the file); a file with only
    some bad events has them skipped, counted in ``RankTrace.bad_events`` and its ``problems``.
    """
    files = list(logdir) if isinstance(logdir, (list, tuple)) else find_trace_files(logdir)
    if not files:
        raise TraceLoadError(
            f"analyze: no trace files (*trace*.json or *trace*.json.gz) under `logdir={logdir!r}`. "
            "Point it at the profiler's output directory (MFUMonitor writes to <log_dir>/profiler)."
        )
    per_rank: dict[int, list[tuple[float, str, _Sink, dict, list[str]]]] = {}
    problems: list[str] = []
    for path in files:
        sink, meta, probs = load_trace(path)
        rank = _rank_of(path, meta)
        _require_usable(path, rank, sink)
        if rank is None:
            problems.append(f"{os.path.basename(path)}: no rank in distributedInfo or file name; skipped")
            continue
        m = _WINDOW_IN_NAME.search(os.path.basename(path))
        order = float(m.group(1)) if m else sink.first_ts
        per_rank.setdefault(rank, []).append((order, path, sink, meta, probs))
    n_windows = max((len(v) for v in per_rank.values()), default=0)
    windows: list[TraceWindow] = []
    for k in range(n_windows):
        built = {}
        key: int | None = None
        for r, entries in sorted(per_rank.items()):
            entries.sort(key=lambda e: (e[0], e[1]))
            if k < len(entries):
                order, path, sink, meta, probs = entries[k]
                m = _WINDOW_IN_NAME.search(os.path.basename(path))
                key = int(m.group(1)) if (m and key is None) else key
                built[r] = _build(r, [path], [sink], [meta], probs)
        windows.append(_window(key if key is not None else k, built, problems))
    if not any(w.ranks for w in windows):
        detail = "; ".join(problems) or "no events"
        raise TraceLoadError(f"analyze: no usable trace under `logdir={logdir!r}` ({detail}).")
    return windows, problems


def _window(key: int, built: dict[int, RankTrace], problems: list[str]) -> TraceWindow:
    usable = {r: t for r, t in built.items() if t.step_windows.size}
    where = f"window {key}: "
    for r, t in built.items():
        if r not in usable:
            problems.append(f"{where}rank {r}: nothing usable ({'; '.join(t.problems) or 'no step or device events'})")
    if not usable:
        return TraceWindow(key, {}, [])
    world = max([t.world_size or 0 for t in usable.values()] + [max(usable) + 1])
    missing = [r for r in range(world) if r not in usable]
    if missing:
        problems.append(f"{where}missing ranks {missing} of world size {world}")
    return TraceWindow(key, usable, missing)
