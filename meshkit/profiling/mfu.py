"""MFUMonitor: a Lightning callback for MFU, HFU, throughput and where the rest of the step went.

Per step (cheap: a few clock reads, no device sync on GPU) it measures the step's wall time
split into disjoint phases (:data:`~meshkit.profiling.report.STEP_PHASES`): the gap since the
previous batch, across epochs (Lightning's stop-signal broadcast, validation, checkpointing and
deleting old checkpoints, the monitor's own profiler overhead, and the rest: data-loader wait),
forward + backward and the optimizer step; a save or validation inside a batch counts once, in its
own phase. :attr:`MFUMonitor.fit_time_s` adds up all of ``fit``: the steps and what lies between
them (:data:`~meshkit.profiling.report.BETWEEN_STEPS_PARTS`). Every ``profile_every`` batches a short ``torch.profiler`` window
(:class:`~meshkit.profiling.window.ProfilerWindows`) adds what only a trace shows inside forward +
backward (exposed communication, pipeline bubble, host idle; see
:mod:`meshkit.profiling.overlap` for the step model and its precedence); the window's batches
use their own trace, and later batches carry the window's figures over.

Definitions (numbers say what they count):

- ``mfu = model FLOPs / (step time · world size · peak)``; model FLOPs exclude recompute
  (PaLM's ``6N + 12·L·H·Q·T`` per token when the model's config is known, else 3 × the
  measured forward).
- ``hfu``: the same with hardware FLOPs, measured once by ``FlopCounterMode`` on a real step
  (activation recompute included), summed over all ranks.
- Tokens are counted once per data-parallel replica: the local batch's tokens × (dp_replicate ·
  dp_shard) × cp, read from ``trainer.strategy.parallel_dims.degrees`` when the strategy has one
  (tp and pp ranks share a replica's tokens; a cp rank's batch holds T/cp of each sequence, so
  its tokens and T are multiplied by cp), else × world size (plain DDP).
- Measured FLOPs: each rank counts its local work (DTensor shards under tp, its stage's layers
  over every micro-batch under pp, its T/cp queries under cp); the forward is what ran outside a
  backward pass (:func:`meshkit.profiling.flops.flop_counter`), which holds under pp too, where
  the schedule runs forward and backward inside ``training_step``.
- The breakdown: the fractions of :data:`~meshkit.profiling.report.BREAKDOWN_PARTS` (compute,
  recompute, exposed_comm, bubble, data_wait, optimizer, validation, checkpoint,
  profiler_overhead, other), each ≥ 0, summing to 1 because the phases partition the step.
  Recompute gets the share of forward+backward compute time equal to its share of hardware FLOPs.

Example::

    >>> import lightning as L
    >>> from meshkit.profiling.mfu import MFUMonitor
    >>> trainer = L.Trainer(max_steps=1, callbacks=[MFUMonitor(profile_every=0)], logger=False,
    ...                     enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
"""

from __future__ import annotations

import math
import os
import time
from collections import deque
from dataclasses import dataclass
from collections.abc import Mapping
from typing import Any, Callable

import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from meshkit.modelspec import find_config
from meshkit.profiling.flops import cpu_peak_key, flop_counter, model_flops_split, normalize_dtype, peak_info
from meshkit.profiling.overlap import compute_split
from meshkit.profiling.report import (BETWEEN_STEPS_PARTS, BREAKDOWN_PARTS, STEP_PHASES, console_block, fit_tag,
                                      step_scalars, waterfall, write_layout, write_window)
from meshkit.profiling.window import ProfilerWindows, WindowSteps
from meshkit.quiet import quiet_lightning_pytree

__all__ = ["MFUMonitor", "StepMetrics", "mesh_factors", "sequence_shards", "batch_tokens", "split_step"]


# ----------------------------------------------------------------------------- pure helpers


def mesh_factors(strategy: Any, world_size: int) -> tuple[int, int]:
    """(data-parallel replicas, world size) for token counting.

    Reads ``strategy.parallel_dims.degrees`` by duck typing (keys ``dp_replicate``, ``dp_shard``,
    ``pp``, ``cp``, ``tp``); without it every rank is its own replica (plain data parallel).

    >>> class S: parallel_dims = type("D", (), {"degrees": {"dp_replicate": 2, "dp_shard": 2, "pp": 1, "cp": 1, "tp": 2}})()
    >>> mesh_factors(S(), 8)
    (4, 8)
    """
    dims = getattr(strategy, "parallel_dims", None)
    degrees = getattr(dims, "degrees", None)
    if not isinstance(degrees, Mapping):
        return world_size, world_size
    dp = int(degrees.get("dp_replicate", 1)) * int(degrees.get("dp_shard", 1))
    total = dp * int(degrees.get("pp", 1)) * int(degrees.get("cp", 1)) * int(degrees.get("tp", 1))
    if total != world_size:
        raise ValueError(
            f"MFUMonitor: the strategy's parallel_dims degrees {dict(degrees)} multiply to {total}, "
            f"not the world size ({world_size}). Check the strategy's ParallelDims."
        )
    return dp, world_size


def sequence_shards(strategy: Any) -> int:
    """How many ranks split each sequence (the ``cp`` degree): the batch a cp rank sees holds T/cp tokens of
    every sequence of its replica, so tokens and T are the local ones × this.

    >>> class S: parallel_dims = type("D", (), {"degrees": {"dp_shard": 2, "cp": 2}})()
    >>> sequence_shards(S()), sequence_shards(object())
    (2, 1)
    """
    degrees = getattr(getattr(strategy, "parallel_dims", None), "degrees", None)
    return int(degrees.get("cp", 1)) if isinstance(degrees, Mapping) else 1


def _token_tensor(batch: Any) -> tuple[Any, bool]:
    """(the tensor that holds the batch's tokens, whether it carries the shifted label column)."""
    if isinstance(batch, Mapping):
        if isinstance(batch.get("input_ids"), torch.Tensor):
            return batch["input_ids"], False
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        batch = next((item for item in batch if isinstance(item, torch.Tensor)), None)
    if isinstance(batch, torch.Tensor):
        # a bare 2-D integer batch is (B, T + 1) tokens: the inputs and the label shifted by one
        return batch, batch.dim() == 2 and not batch.is_floating_point() and batch.shape[-1] > 1
    return None, False


def batch_tokens(batch: Any) -> int:
    """Tokens trained on in one local batch: ``input_ids`` of a dict batch; a bare 2-D integer (B, T + 1)
    token tensor counts B·T (its last column is only a label); else the first tensor's element count.

    >>> batch_tokens(torch.zeros(4, 129, dtype=torch.long)), batch_tokens({"input_ids": torch.zeros(4, 128)})
    (512, 512)
    """
    tensor, shifted = _token_tensor(batch)
    if tensor is None:
        raise ValueError(f"MFUMonitor: cannot count tokens in a batch of type {type(batch).__name__}; "
                         "pass `tokens_fn=lambda batch: <tokens in it>`.")
    n = tensor.numel()
    return n - n // tensor.shape[-1] if shifted else n  # shifted: B·(T + 1) - B


def _batch_seq_len(batch: Any) -> int | None:
    """T for the attention term: the trained sequence length (without the label shift)."""
    tensor, shifted = _token_tensor(batch)
    if tensor is None or tensor.dim() < 1:
        return None
    return int(tensor.shape[-1]) - (1 if shifted else 0)


@dataclass
class _Window:
    """What a profiled window says about forward+backward, per batch (ms)."""

    step: int
    fwd_bwd_ms: float
    """Forward+backward time of the batches the figures below were measured on."""
    exposed_ms: float
    bubble_ms: float
    other_ms: float
    """Host time between ops inside forward+backward (no op, no collective in flight)."""


def split_step(step_ms: float, data_ms: float, fwd_bwd_ms: float, optimizer_ms: float,
               window: _Window | None, recompute_share: float, *, validation_ms: float = 0.0,
               checkpoint_ms: float = 0.0, profiler_ms: float = 0.0, stop_signal_ms: float = 0.0) -> dict[str, float]:
    """The step's wall time as fractions of :data:`~meshkit.profiling.report.BREAKDOWN_PARTS` (≥ 0, sum 1).

    The timers give data wait, validation, checkpointing, the monitor's own profiler overhead,
    forward+backward and optimizer (disjoint phases of the step). Inside forward+backward the
    latest window says how much was exposed comm and bubble (carried in ms: a profiler slows
    the recorded ops, not the time spent waiting) and host time between ops (carried as a share
    of forward+backward, since the profiler slows that like the ops); compute is the rest, of
    which ``recompute_share`` is recompute. ``stop_signal_ms`` (between the batches: ranks waiting in
    Lightning's stop-signal broadcast for a slow rank) is exposed comm too. Anything the phases leave of
    ``step_ms`` is other.

    >>> f = split_step(100, 10, 70, 20, None, 0.0)
    >>> f["compute"], f["data_wait"], f["optimizer"]
    (0.7, 0.1, 0.2)
    """
    parts = dict.fromkeys(BREAKDOWN_PARTS, 0.0)
    if step_ms <= 0:
        return parts
    fb = max(fwd_bwd_ms, 0.0)
    exposed = bubble = idle = 0.0
    if window is not None:
        exposed = min(max(window.exposed_ms, 0.0), fb)
        bubble = min(max(window.bubble_ms, 0.0), fb - exposed)
        share = window.other_ms / window.fwd_bwd_ms if window.fwd_bwd_ms > 0 else 0.0
        idle = min(max(share, 0.0) * fb, fb - exposed - bubble)
    rest = fb - exposed - bubble - idle
    ms = {"compute": rest * (1 - recompute_share), "recompute": rest * recompute_share,
          "exposed_comm": exposed + max(stop_signal_ms, 0.0),
          "bubble": bubble, "data_wait": max(data_ms, 0.0), "optimizer": max(optimizer_ms, 0.0),
          "validation": max(validation_ms, 0.0), "checkpoint": max(checkpoint_ms, 0.0),
          "profiler_overhead": max(profiler_ms, 0.0), "other": idle}
    ms["other"] += max(step_ms - sum(ms.values()), 0.0)
    total = sum(ms.values())
    return {k: ms[k] / total for k in BREAKDOWN_PARTS} if total > 0 else parts


@dataclass
class StepMetrics:
    """What MFUMonitor computed for one step (logged as :meth:`scalars`; tags and units in
    :mod:`meshkit.profiling.report`)."""

    step: int
    step_time_s: float
    mfu: float
    hfu: float
    tflops_per_device: float
    """Model TFLOP/s per device."""
    hardware_tflops_per_device: float
    tokens_per_s: float
    """Global: tokens of every dp replica."""
    tokens_per_s_per_device: float
    breakdown: dict[str, float]

    def scalars(self) -> dict[str, float]:
        """This step's TensorBoard scalars by tag, in their units (:func:`meshkit.profiling.report.step_scalars`)."""
        return step_scalars(self.mfu, self.hfu, self.breakdown, step_time_s=self.step_time_s,
                            tflops_per_device=self.tflops_per_device,
                            hardware_tflops_per_device=self.hardware_tflops_per_device,
                            tokens_per_s=self.tokens_per_s, tokens_per_s_per_device=self.tokens_per_s_per_device)


# --------------------------------------------------------------------------------- callback


_UNSET = object()


def _stop_signal_call(trainer: Any) -> tuple[Any, str] | None:
    """(owner, method) of Lightning's per-batch stop-signal broadcast: ``_TrainingEpochLoop.
    _broadcast_sigterm_tensor`` (private; checked on Lightning 2.6.6: called at the start of every
    batch when world size > 1, a broadcast on the world group in which every rank waits for the slowest).
    None where the loop has no such method (Fabric, another Lightning)."""
    loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    return (loop, "_broadcast_sigterm_tensor") if callable(getattr(loop, "_broadcast_sigterm_tensor", None)) else None


class _Clock:
    """One step's phase stamps: CUDA events on GPU, perf_counter on CPU.

    A GPU step's events are read one step late (``deferred``): by the end of the next step the
    host has queued that step's work behind them, so waiting on them never drains the device.
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.deferred = self.cuda
        self.marks: dict[str, Any] = {}
        self.nested: dict[str, dict[str, float]] = {}
        """Host ms of phases that ran inside this batch (a save from ``training_step``), by the clock phase
        they ran in: ``{"forward_backward": {"checkpoint": ms}, "optimizer": {...}}``."""

    def add_nested(self, phase: str, ms: float) -> None:
        where = self.nested.setdefault("optimizer" if "opt" in self.marks else "forward_backward", {})
        where[phase] = where.get(phase, 0.0) + ms

    def phases_ms(self) -> tuple[float, float]:
        """(forward+backward, optimizer) in ms: start → opt → end, or start → end without an optimizer mark;
        each without the nested phases that ran inside it (:attr:`nested`: counted in their own phase)."""
        fb, opt = (self.ms("start", "opt"), self.ms("opt", "end")) if "opt" in self.marks else \
            (self.ms("start", "end"), 0.0)
        inner = lambda where: sum(self.nested.get(where, {}).values())  # noqa: E731
        return max(fb - inner("forward_backward"), 0.0), max(opt - inner("optimizer"), 0.0)

    def nested_ms(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for per in self.nested.values():
            for k, v in per.items():
                out[k] = out.get(k, 0.0) + v
        return out

    def mark(self, name: str) -> None:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.marks[name] = ev
        else:
            self.marks[name] = time.perf_counter()

    def ms(self, a: str, b: str) -> float:
        if a not in self.marks or b not in self.marks:
            return 0.0
        if self.cuda:
            self.marks[b].synchronize()
            return float(self.marks[a].elapsed_time(self.marks[b]))
        return 1e3 * (self.marks[b] - self.marks[a])


class MFUMonitor(Callback):
    """Log MFU, HFU, TFLOP/s per device, tokens/s and the MFU breakdown to the run's TensorBoard.

    Args:
        peak_flops: dense peak FLOP/s of one device; default from :func:`meshkit.profiling.flops.peak_info`
            (datasheet on GPU, a measured matmul peak on CPU).
        dtype: compute dtype for the peak lookup; default from the Trainer's precision.
        flops_per_token: model FLOPs per token; default ``6N + 12·L·H·Q·T`` from the config the module
            holds (:func:`meshkit.modelspec.find_config`: ``config``, ``model.config``, ...), else 3 × the
            measured forward.
        seq_len: T for the attention term (the full sequence, not a cp shard); default the batch's last
            dimension (minus the label column of a bare (B, T + 1) token tensor) × cp.
        tokens_fn: ``batch -> tokens`` in one local batch (× dp × cp for the global count); default
            :func:`batch_tokens`.
        measure_flops: count hardware FLOPs with ``FlopCounterMode`` on training batch
            ``flop_count_batch`` (that step is not timed).
        profile_every: a torch.profiler window every this many batches (0: never).
        profile_start: batch index of the first window.
        profile_steps: active steps per window (after one warm-up step).
        profile_budget: the largest share of training time the profiler windows may take (default
            0.5 %, so that with the per-step timers the monitor stays under 1 %). Each
            window's cost is measured (its steps' slow-down, trace export, analysis and TensorBoard
            writing, the slowest rank's); the next window starts ``profile_every`` batches on, or later,
            so that all windows together (the next one counted at the last one's cost) stay within
            ``profile_budget`` of the training time (batches × the median plain step).
            ``None``: a window every ``profile_every`` batches whatever it costs.
        log_every: log scalars every this many batches (default: the Trainer's log_every_n_steps).
        trace_dir: where traces go (default ``<log_dir>/profiler``; ``meshkit analyze`` reads them, and
            Chrome-trace viewers such as Perfetto open them).
        doctor: moved: ``meshkit.Doctor(mfu=True)`` switches this monitor on (the doctor sits above profiling).

    Example::

        trainer = L.Trainer(callbacks=[MFUMonitor(profile_every=200)])
    """

    def __init__(self, *, peak_flops: float | None = None, dtype: Any = None, flops_per_token: float | None = None,
                 seq_len: int | None = None, tokens_fn: Callable[[Any], int] | None = None,
                 measure_flops: bool = True, flop_count_batch: int = 1, profile_every: int = 100,
                 profile_start: int = 5, profile_steps: int = 2, profile_budget: float | None = 0.005,
                 log_every: int | None = None,
                 trace_dir: str | None = None, history: int = 10_000, doctor: bool = False) -> None:
        if doctor:
            raise ValueError("MFUMonitor: `doctor=True` moved to the Doctor: use "
                             "`callbacks=[meshkit.Doctor(mfu=True)]` (or `meshkit.Doctor(mfu=MFUMonitor(...))`).")
        for name, value in (("profile_every", profile_every), ("profile_start", profile_start),
                            ("flop_count_batch", flop_count_batch)):
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"MFUMonitor: `{name}={value!r}` must be an int >= 0.")
        if not isinstance(profile_steps, int) or profile_steps < 1:
            raise ValueError(f"MFUMonitor: `profile_steps={profile_steps!r}` must be an int >= 1.")
        if profile_budget is not None and not (isinstance(profile_budget, (int, float)) and 0 < profile_budget <= 1):
            raise ValueError(f"MFUMonitor: `profile_budget={profile_budget!r}` must be in (0, 1] (or None).")
        if log_every is not None and (not isinstance(log_every, int) or log_every < 1):
            raise ValueError(f"MFUMonitor: `log_every={log_every!r}` must be an int >= 1 (or None).")
        if peak_flops is not None and not (isinstance(peak_flops, (int, float)) and peak_flops > 0):
            raise ValueError(f"MFUMonitor: `peak_flops={peak_flops!r}` must be a positive number of FLOP/s.")
        self.peak_flops, self.dtype, self.flops_per_token = peak_flops, dtype, flops_per_token
        self.seq_len, self.tokens_fn, self.measure_flops = seq_len, tokens_fn or batch_tokens, measure_flops
        self.flop_count_batch, self.profile_every = flop_count_batch, profile_every
        self.profile_start, self.profile_steps, self.profile_budget = profile_start, profile_steps, profile_budget
        self.log_every, self.trace_dir = log_every, trace_dir
        self.history: deque[StepMetrics] = deque(maxlen=history)
        self.peak_source = ""
        self.windows: list[_Window] = []
        self._reset()

    def _reset(self) -> None:
        self._batches = 0
        self._clock: _Clock | None = None
        self._prev_end: float | None = None
        self._t_start = 0.0
        self._counting: Any = None
        self._model_per_token: float | None = None  # global model FLOPs per global token
        self._attention_share = 0.0  # of model FLOPs: the 12·L·H·Q·T term
        self._flops_source = ""
        self._hw_factor = 1.0
        self._fwd_model_per_token: float | None = None
        self.measured_flops: dict[str, float] = {}
        self._recompute_share = 0.0
        self._win: ProfilerWindows | None = None
        self._in_window: dict[int, dict[str, float]] = {}  # batch -> its trace buckets (ms), last window
        self._window_stop_ms: dict[int, float] = {}  # profiled batch -> its timed stop-signal wait (ms)
        self.window_summaries: list[dict[str, Any]] = []
        # s since the last batch, by named phase (STEP_PHASES between the batches; data_wait is the rest)
        self._gap = dict.fromkeys(("stop_signal", "validation", "checkpoint", "profiler_overhead"), 0.0)
        self._phase_t0: dict[str, float] = {}
        self._phase_credit: dict[str, float] = {}  # s of inner phases inside an open one
        self._in_batch = False
        self._t_fit0: float | None = None
        self._t_train_end: float | None = None
        self._sanity_t0: float | None = None
        self._fit_steps_ms = dict.fromkeys(STEP_PHASES, 0.0)
        self._fit_between_ms = dict.fromkeys(BETWEEN_STEPS_PARTS, 0.0)
        self._fit_n_steps = 0
        self.fit_time_s: dict[str, Any] = {}
        self._pending: list[StepMetrics] = []
        self._unread: list[tuple[int, float, dict[str, float], _Clock, bool]] = []
        self._plain_step_s: deque[float] = deque(maxlen=64)  # recent steps outside profiler windows
        self._log_dir: str | None = None
        self._wrapped: list[tuple[Any, str, Any]] = []

    @property
    def profile_windows(self) -> list[dict[str, float]]:
        """Per finished window: its first batch, cost (s, slowest rank), step time (s) and next window's batch."""
        return self._win.history if self._win is not None else []

    # ------------------------------------------------------------------ setup

    @override
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        quiet_lightning_pytree()  # Lightning's own LeafSpec warning, also in a one-device run (meshkit.quiet)
        if stage != "fit":
            return
        self.begin(trainer, pl_module.device if pl_module.device.type != "meta" else torch.device("cpu"))

    def begin(self, trainer: Any, device: torch.device, save: tuple[Any, str] | None = None) -> None:
        """Start measuring a run: what ``setup`` does for the Trainer, and :class:`~meshkit.profiling.fabric.FabricMFU`
        for a Fabric loop (``trainer`` then a view of the Fabric). ``save``: ``(owner, method name)`` whose calls are
        timed as checkpointing (default ``trainer.save_checkpoint``)."""
        self._reset()
        self._t_fit0 = time.perf_counter()
        self._dp, self._world = mesh_factors(trainer.strategy, trainer.world_size)
        self._cp = sequence_shards(trainer.strategy)
        self._device = device
        self._log_dir = trainer.log_dir  # collective: every rank calls setup
        if self.trace_dir is None:
            self.trace_dir = os.path.join(self._log_dir or trainer.default_root_dir, "profiler")
        self._rank = trainer.global_rank
        if self.log_every is None:
            self.log_every = max(int(getattr(trainer, "log_every_n_steps", 50) or 1), 1)
        dtype = self.dtype if self.dtype is not None else self._precision_dtype(trainer)
        self._peak, self.peak_source = self._run_peak(trainer, dtype)
        self._win = ProfilerWindows(self.trace_dir, self._rank, self.profile_every, self.profile_start,
                                    self.profile_steps, self.profile_budget, cuda=self._device.type == "cuda",
                                    metadata={"meshkit_peak": {"flops": self._peak, "source": self.peak_source},
                                              "meshkit_mesh_groups": self._mesh_groups(trainer)})
        self._wrap(*(save or (trainer, "save_checkpoint")), "checkpoint")
        self._wrap(trainer.strategy, "remove_checkpoint", "checkpoint")  # ModelCheckpoint's delete of the old one
        stop = _stop_signal_call(trainer)
        if stop is not None:
            self._wrap(*stop, "stop_signal")
        if trainer.is_global_zero and self.profile_every:
            writer = self._writer(trainer)
            if writer is not None:
                write_layout(writer)

    def _run_peak(self, trainer: Any, dtype: str) -> tuple[float, str]:
        """One peak per run: rank 0 resolves it (a CPU peak is calibrated there, once) and every rank
        takes rank 0's, so per-rank MFU and waterfalls compare (ranks calibrating each on its own, on a
        loaded host, measured peaks about 2x apart)."""
        peak, source = 0.0, ""
        if trainer.is_global_zero or self._world == 1:
            if self.peak_flops is not None:
                peak, source = float(self.peak_flops), "override"
            else:
                name = torch.cuda.get_device_name(self._device) if self._device.type == "cuda" else "cpu"
                info = peak_info(name, dtype)
                peak, source = info.flops, f"{info.kind}: {info.row} {info.dtype} ({info.source})"
                if info.kind == "measured":  # which calibration: CPU model, cores, dtype, threads, torch
                    source += f", {info.flops / 1e9:.1f} GFLOP/s [{cpu_peak_key(info.dtype)}]"
        if self._world > 1:
            peak, source = trainer.strategy.broadcast((peak, source), src=0)
            source += f"; resolved on rank 0, shared with all {self._world} ranks"
        return float(peak), source

    def _mesh_groups(self, trainer: Any) -> dict[str, Any]:
        """The mesh axes' process groups on this rank, ``{axis: {"group_name", "ranks"}}``, written into
        every trace: ``meshkit analyze`` maps each collective's group (``record_param_comms``' group name
        and ranks) to its axis with it. From the strategy's ``device_mesh`` (duck typed); without a mesh
        every rank is a replica (plain DDP): the world group is ``dp_replicate``."""
        import torch.distributed as dist

        if self._world == 1 or not dist.is_available() or not dist.is_initialized():
            return {}
        try:
            mesh = getattr(trainer.strategy, "device_mesh", None)
        except RuntimeError:  # Lightning's ModelParallelStrategy before its mesh exists
            mesh = None
        names = getattr(mesh, "mesh_dim_names", None)
        if mesh is None or not names:  # every rank a replica: the world group is dp_replicate, the rest size 1
            world = dist.group.WORLD
            alone = {"group_name": None, "ranks": [self._rank]}
            return {"dp_replicate": {"group_name": world.group_name, "ranks": list(range(self._world))},
                    **{axis: alone for axis in ("dp_shard", "pp", "cp", "tp")}}
        groups = {name: mesh.get_group(name) for name in names}
        return {name: {"group_name": pg.group_name, "ranks": dist.get_process_group_ranks(pg)}
                for name, pg in groups.items()}

    def _wrap(self, owner: Any, attr: str, phase: str) -> None:
        """Time ``owner.<attr>`` as ``phase`` and mark it in windows (``trainer.save_checkpoint`` and
        ``strategy.remove_checkpoint``: checkpointing has no end hook; the stop-signal broadcast: no hook)."""
        if any(o is owner and a == attr for o, a, _ in self._wrapped) or not hasattr(owner, attr):
            return
        original = getattr(owner, attr)

        def timed(*args: Any, **kwargs: Any) -> Any:
            self._phase_begin(phase)
            try:
                return original(*args, **kwargs)
            finally:
                self._phase_end(phase)

        before = owner.__dict__.get(attr, _UNSET) if hasattr(owner, "__dict__") else _UNSET
        self._wrapped.append((owner, attr, before))
        setattr(owner, attr, timed)

    @override
    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        for owner, attr, before in reversed(self._wrapped):
            if before is _UNSET:
                owner.__dict__.pop(attr, None)  # the class's method again
            else:
                setattr(owner, attr, before)  # what the instance held before (e.g. a user's own wrapper)
        self._wrapped = []
        if self._t_train_end is not None and self.fit_time_s:
            self._fit_between_ms["teardown"] += 1e3 * (time.perf_counter() - self._t_train_end)
            self._t_train_end = None
            self.fit_time_s = self._fit_summary()

    @staticmethod
    def _precision_dtype(trainer: Any) -> str:
        precision = str(getattr(trainer, "precision", "32-true"))
        key = normalize_dtype(precision) if precision not in ("32-true", "32", "64-true") else "fp32"
        if key == "fp32" and torch.cuda.is_available() and torch.backends.cuda.matmul.allow_tf32:
            return "tf32"
        return key

    @staticmethod
    def _writer(trainer: Any) -> Any:
        for logger in getattr(trainer, "loggers", []):
            exp = getattr(logger, "experiment", None)
            if exp is not None and hasattr(exp, "add_custom_scalars"):
                return exp
        return None

    # ------------------------------------------------------------------ per-step hooks

    def _phase_begin(self, phase: str) -> None:
        self._phase_t0[phase] = time.perf_counter()
        if self._win is not None:
            self._win.mark_begin(phase)

    def _phase_end(self, phase: str) -> None:
        t0 = self._phase_t0.pop(phase, None)
        if self._win is not None:
            self._win.mark_end(phase)
        if t0 is None or phase not in self._gap:
            return
        now = time.perf_counter()
        # a phase inside another (a save from on_validation_epoch_end) counts once, in the inner one
        outer = max((p for p, t in self._phase_t0.items() if t <= t0 and p in self._gap),
                    key=lambda p: self._phase_t0[p], default=None)
        if outer is not None:
            self._phase_credit[outer] = self._phase_credit.get(outer, 0.0) + (now - t0)
        took = now - t0 - self._phase_credit.pop(phase, 0.0)
        if self._in_batch and self._clock is not None:  # e.g. a save from training_step: out of its clock phase
            self._clock.add_nested(phase, 1e3 * took)
        else:
            self._gap[phase] += took

    @override
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._start_steps()

    def _start_steps(self) -> None:
        """The steps start: what came since setup is ``setup`` (but the sanity check); every batch's step
        runs from the previous batch's end (epochs included)."""
        now = time.perf_counter()
        if self._t_fit0 is not None:
            sanity = self._fit_between_ms["sanity_check"]
            self._fit_between_ms["setup"] += max(1e3 * (now - self._t_fit0) - sanity, 0.0)
        self._prev_end = now

    @override
    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        # Not a step boundary: the time since the last batch (epoch-end validation, checkpointing, the new
        # iterator) belongs to the next step's phases. Only a loop without on_train_start (Fabric) starts here.
        if self._prev_end is None:
            self._start_steps()

    @override
    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        if trainer.sanity_checking:
            self._sanity_t0 = time.perf_counter()
        else:
            self._phase_begin("validation")

    @override
    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        if trainer.sanity_checking:
            if self._sanity_t0 is not None:
                self._fit_between_ms["sanity_check"] += 1e3 * (time.perf_counter() - self._sanity_t0)
            self._sanity_t0 = None
        else:
            self._phase_end("validation")

    @override
    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        b = self._batches
        if self._model_per_token is None and (b > self.flop_count_batch or not self.measure_flops):
            self._resolve_flops(trainer, pl_module, batch)  # (before a window starts: its trace records them)
        if self._win is not None and self._win.due(b) and b != self.flop_count_batch and self._window_fits(trainer):
            t0 = time.perf_counter()
            self._window_flops(batch)
            self._win.start(b)
            self._gap["profiler_overhead"] += time.perf_counter() - t0
        self._t_start = time.perf_counter()
        self._clock = _Clock(self._device)
        self._clock.mark("start")
        self._in_batch = True
        if self._win is not None:
            self._win.mark_begin("forward_backward")
        if self.measure_flops and b == self.flop_count_batch and not (self._win and self._win.active):
            self._counting = flop_counter()
            self._counting.__enter__()
        self._batch = batch

    @override
    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if self._clock is not None:
            self._clock.mark("opt")
        if self._win is not None:
            self._win.mark_end("forward_backward")
            self._win.mark_begin("optimizer")
        if self._counting is not None:
            self._finish_count(trainer)

    @override
    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        clock = self._clock
        if self._counting is not None:  # manual optimization without on_before_optimizer_step
            self._finish_count(trainer)
        if clock is not None:
            clock.mark("end")
        now = time.perf_counter()
        self._in_batch = False
        gap_s = self._t_start - self._prev_end if self._prev_end is not None else 0.0
        gap = {k: 1e3 * v for k, v in self._gap.items()}
        gap["data_wait"] = max(1e3 * gap_s - sum(gap.values()), 0.0)
        self._gap = dict.fromkeys(self._gap, 0.0)
        b = self._batches
        self._batches += 1
        win = self._win
        in_window = win is not None and win.active
        if clock is not None and not (b == self.flop_count_batch and self.measure_flops):
            self._unread.append((b, self._global_tokens(batch), gap, clock, in_window))
        elif self._prev_end is not None:  # the FLOP-counted step is slow by design: not a measurement
            named = {k: v for k, v in gap.items() if k in self._fit_between_ms}
            for k, v in named.items():
                self._fit_between_ms[k] += v
            self._fit_between_ms["flop_count_step"] += max(1e3 * (now - self._prev_end) - sum(named.values()), 0.0)
        if in_window:
            t0 = time.perf_counter()
            win.mark_end_all()
            if win.step():
                self._end_window(trainer)
            self._gap["profiler_overhead"] += time.perf_counter() - t0
            self._read_steps(trainer, keep=0 if not win.active else len(self._unread))
        else:
            self._read_steps(trainer, keep=1 if clock is not None and clock.deferred else 0)
        self._prev_end = now  # the window's own work after it is profiler_overhead of the next gap

    def _read_steps(self, trainer: Any, keep: int = 0) -> None:
        """Record the steps whose clocks are read, leaving the newest ``keep`` (deferred GPU reads,
        or the batches of a window whose trace is not read yet)."""
        while len(self._unread) > keep:
            b, tokens, gap, clock, in_window = self._unread.pop(0)
            fb_ms, opt_ms = clock.phases_ms()
            nested = clock.nested_ms()
            gap = {k: v + nested.get(k, 0.0) for k, v in gap.items()}  # each phase once, wherever it ran
            step_ms = sum(gap.values()) + fb_ms + opt_ms
            for k, v in {**gap, "forward_backward": fb_ms, "optimizer": opt_ms}.items():
                self._fit_steps_ms[k] += v
            self._fit_n_steps += 1
            if not in_window:
                self._plain_step_s.append(step_ms / 1e3)
            if self._model_per_token is not None and step_ms > 0:
                self._record(trainer, b, tokens, step_ms, gap, fb_ms, opt_ms)

    # ------------------------------------------------------------------ FLOPs

    def _global_tokens(self, batch: Any) -> float:
        # a cp rank's batch holds T/cp of each of its replica's sequences (the strategy shards it)
        return float(self.tokens_fn(batch)) * self._dp * self._cp

    def _resolve_flops(self, trainer: Any, pl_module: Any, batch: Any) -> None:
        if self.flops_per_token is not None:
            self._model_per_token = float(self.flops_per_token)
            self._flops_source = "flops_per_token (no attention term, all matmul)"
        else:
            cfg = find_config(pl_module)
            if cfg is not None:
                try:
                    local_t = _batch_seq_len(batch)
                    t = self.seq_len or (local_t * self._cp if local_t is not None else None)
                    mm, att = model_flops_split(cfg, seq_len=t)
                    self._model_per_token, self._attention_share = mm + att, att / (mm + att)
                    self._flops_source = "6N + 12·L·H·Q·T from the model's config"
                except ValueError:
                    self._model_per_token = None
        if self._model_per_token is None:
            self._model_per_token = self._fwd_model_per_token
            self._flops_source = "3 x the measured forward (no config: no attention term, all matmul)"
        if self._model_per_token is None:
            raise ValueError(
                "MFUMonitor: cannot tell the model's FLOPs: the module has no `config` (HF, torchtitan args or "
                "meshkit LlamaConfig) and `measure_flops=False`. Pass `flops_per_token=` or enable measure_flops."
            )

    def _window_flops(self, batch: Any) -> None:
        """Write this step's model FLOPs per device into the window's trace (``meshkit_flops``), split into
        the matmul (6N) and attention (12·L·H·Q·T) terms, for ``meshkit analyze``'s waterfall."""
        if self._model_per_token is None or self._win is None:
            return
        per_device = self._model_per_token * self._global_tokens(batch) / self._world
        self._win.metadata["meshkit_flops"] = {
            "matmul": per_device * (1 - self._attention_share), "attention": per_device * self._attention_share,
            "recompute_share": self._recompute_share, "source": self._flops_source}

    def _finish_count(self, trainer: Any) -> None:
        """Stop counting; sum this step's forward and total FLOPs over the ranks (forward: the ops run outside
        any backward pass, so a pipeline schedule's micro-batches, run inside training_step, split right)."""
        counter, self._counting = self._counting, None
        passes = counter.flops_by_pass
        counter.__exit__(None, None, None)
        local = torch.tensor([passes["forward"], passes["forward"] + passes["backward"]], dtype=torch.float64)
        if self._world > 1:
            dev = self._device if self._device.type == "cuda" else torch.device("cpu")
            local = trainer.strategy.reduce(local.to(dev), reduce_op="sum").cpu()
        fwd, total = float(local[0]), float(local[1])
        self.measured_flops = {"forward": fwd, "hardware": total, "tokens": self._global_tokens(self._batch)}
        if fwd > 0 and total > 0:
            # HFU / MFU = hardware / model FLOPs as measured (model = 3 x forward), so the two
            # ratios share one convention even when the analytic formula is used for MFU.
            self._hw_factor = max(total / (3 * fwd), 1.0)
            self._recompute_share = max(total - 3 * fwd, 0.0) / total
            self._fwd_model_per_token = 3 * fwd / self.measured_flops["tokens"]

    # ------------------------------------------------------------------ profiler window

    def _window_fits(self, trainer: Any) -> bool:
        # a window needs 1 warm-up + profile_steps batches; never start one the run cannot finish
        max_steps = getattr(trainer, "max_steps", -1)
        return not (isinstance(max_steps, int) and max_steps > 0
                    and max_steps - trainer.global_step < 1 + self.profile_steps)

    def _end_window(self, trainer: Any) -> None:
        """Stop the window, parse this rank's trace, record its batches with it, write the summary."""
        win = self._win
        steps = win.stop()
        self._in_window, self._window_stop_ms = {}, {}
        if steps is not None:
            self._in_window = dict(zip(steps.batches, steps.buckets_ms))
            tl_bubble = self._timeline_bubble_ms()
            if tl_bubble is not None:
                for v in self._in_window.values():
                    v["bubble"] = tl_bubble
        self._read_steps(trainer)  # the window's batches, each with its own trace buckets (a sync on GPU)
        trainer.strategy.barrier("meshkit_mfu_window")  # every rank's trace of this window is on disk
        summary = self._window_summary(steps)
        if summary is not None:
            self.window_summaries.append(summary)
            if trainer.is_global_zero:
                self._write_window(trainer, summary, steps)
                if len(self.window_summaries) == 1:  # the console: once, after the first profiled window
                    print(console_block(summary["waterfall"], f"meshkit MFU (rank 0, batches "
                                        f"{summary['batches'][0]}-{summary['batches'][-1]})"), flush=True)
        # after rank 0's writing, which every rank would wait for at its next collective anyway
        self._schedule_next_window(trainer)

    def _window_summary(self, steps: WindowSteps | None) -> dict[str, Any] | None:
        """One breakdown of the window's own batches: the numbers its table, waterfall and scalars show."""
        if steps is None:
            return None
        mine = [m for m in self.history if m.step in self._in_window]
        if not mine:
            return None
        total_s = sum(m.step_time_s for m in mine)
        fractions = {p: sum(m.breakdown[p] * m.step_time_s for m in mine) / total_s for p in BREAKDOWN_PARTS}
        mfu = sum(m.mfu * m.step_time_s for m in mine) / total_s
        # the compute bucket split as the window's trace splits its compute time (COMPUTE_CLASSES)
        split = {k: float(v.sum()) for k, v in compute_split(steps.trace, steps.claims).items()}
        total = sum(split.values())
        classes = {k: split[k] / total for k in ("attention", "matmul")} if total > 0 else {}
        delivered = {"attention": mfu * self._attention_share, "matmul": mfu * (1 - self._attention_share)}
        return {"first": steps.first, "batches": [m.step for m in mine], "breakdown": fractions,
                "mfu": mfu, "step_time_s": total_s / len(mine), "waterfall": waterfall(fractions, classes, delivered),
                "trace_buckets_ms": {k: steps.mean(k) for k in steps.buckets_ms[0]}}

    def _schedule_next_window(self, trainer: Any) -> None:
        """Measure what this window cost and agree with every rank on the batch of the next one."""
        recent = sorted(self._plain_step_s or [m.step_time_s for m in list(self.history)[-64:]])
        step_s = recent[len(recent) // 2] if recent else 0.0
        agreed = torch.tensor([self._win.cost_s(step_s), step_s], dtype=torch.float64)
        if self._world > 1:
            dev = self._device if self._device.type == "cuda" else torch.device("cpu")
            agreed = trainer.strategy.reduce(agreed.to(dev), reduce_op="max").cpu()
        self._win.schedule(float(agreed[0]), float(agreed[1]))

    def _timeline_bubble_ms(self) -> float | None:
        from meshkit.profiling.bubble import measured_bubble
        from meshkit.timeline import find_timeline_dir, read_timeline

        if not self._log_dir or not os.path.isdir(self._log_dir):
            return None
        tdir = find_timeline_dir(self._log_dir)
        if tdir is None:
            return None
        try:
            records = [r for r in read_timeline(tdir) if r.rank == self._rank]
        except ValueError:
            return None
        steps = sorted({r.step for r in records})[-self.profile_steps:]
        if not steps:
            return None
        m = measured_bubble([r for r in records if r.step in steps])
        rank = m.per_rank.get(self._rank)
        return rank.idle_ns / 1e6 / len(steps) if rank else None

    def _axis_ms(self, overlap: dict[str, Any] | None, summary: dict[str, Any]) -> dict[str, float] | None:
        """This rank's exposed communication per mesh axis, ms per profiled step (``meshkit analyze``'s)."""
        entry = (overlap or {}).get("ranks", {}).get(str(self._rank), {})
        axes, n = entry.get("exposed_comm_by_axis_ms"), max(entry.get("steps", 0), 1)
        return {k: v / n for k, v in axes.items()} if isinstance(axes, dict) else None

    def _write_window(self, trainer: Any, summary: dict[str, Any], steps: WindowSteps) -> None:
        writer = self._writer(trainer)
        if writer is None:
            return
        from meshkit.profiling.overlap import analyze_window
        from meshkit.profiling.trace import load_rank_trace

        first = summary["first"]
        ranks = {self._rank: steps.trace}  # this rank's trace is parsed already; the others once each here
        for r in range(self._world):
            if r != self._rank and os.path.exists(self._win.path(first, r)):
                ranks[r] = load_rank_trace(self._win.path(first, r), r)
        try:
            overlap = analyze_window({r: t for r, t in ranks.items() if t is not None and t.step_windows.size})
        except ValueError:
            overlap = None
        gantt = None
        try:
            from meshkit.profiling.bubble import gantt_figure
            from meshkit.timeline import find_timeline_dir, read_timeline

            tdir = find_timeline_dir(self._log_dir) if self._log_dir else None
            if tdir:
                gantt = gantt_figure(read_timeline(tdir), title=f"pipeline timeline (last step before {first})")
        except ValueError:
            gantt = None
        write_window(writer, trainer.global_step, summary["breakdown"], summary["mfu"], summary["step_time_s"],
                     overlap, gantt, title=f"MFU breakdown, rank {self._rank}, window of batches "
                     f"{summary['batches'][0]}-{summary['batches'][-1]}", peak_source=self.peak_source,
                     points=summary["waterfall"], exposed_comm_by_axis_ms=self._axis_ms(overlap, summary))

    # ------------------------------------------------------------------ metrics

    def _record(self, trainer: Any, b: int, tokens: float, step_ms: float, gap: dict[str, float], fb_ms: float,
                opt_ms: float) -> None:
        t = step_ms / 1e3
        model = self._model_per_token * tokens
        hw = model * self._hw_factor
        denom = t * self._world * self._peak
        own = self._in_window.get(b)
        if own is not None:  # a profiled batch: its own trace (its stop-signal wait is the timers', below)
            window = _Window(b, fb_ms, own["exposed_comm"] - own.get("stop_signal", 0.0), own["bubble"], own["other"])
            self._window_stop_ms[b] = gap["stop_signal"]
        else:
            window = self.windows[-1] if self.windows else None
        metrics = StepMetrics(
            step=b, step_time_s=t, mfu=model / denom, hfu=hw / denom,
            tflops_per_device=model / self._world / t / 1e12, hardware_tflops_per_device=hw / self._world / t / 1e12,
            tokens_per_s=tokens / t, tokens_per_s_per_device=tokens / t / self._world,
            breakdown=split_step(step_ms, gap["data_wait"], fb_ms, opt_ms, window, self._recompute_share,
                                 validation_ms=gap["validation"], checkpoint_ms=gap["checkpoint"],
                                 profiler_ms=gap["profiler_overhead"], stop_signal_ms=gap["stop_signal"]),
        )
        self.history.append(metrics)
        self._pending.append(metrics)
        if own is not None and b == max(self._in_window):
            self.windows.append(self._carried_window())
        if len(self._pending) >= (self.log_every or 1):
            self._flush(trainer)

    def _carried_window(self) -> _Window:
        """What later batches take from the window: its batches' mean exposed comm, bubble and host idle inside
        forward+backward (without the stop-signal wait between batches: every batch has its own, timed)."""
        mine = [(m, self._in_window[m.step]) for m in self.history if m.step in self._in_window]
        n = max(len(mine), 1)
        stop = sum(self._window_stop_ms.get(m.step, 0.0) for m, _ in mine) / n
        fb = sum(m.step_time_s * (m.breakdown["compute"] + m.breakdown["recompute"] + m.breakdown["exposed_comm"]
                                  + m.breakdown["bubble"] + m.breakdown["other"]) for m, _ in mine) * 1e3 / n - stop
        mean = lambda k: sum(m.step_time_s * m.breakdown[k] for m, _ in mine) * 1e3 / n  # noqa: E731
        return _Window(max(self._in_window), fb, max(mean("exposed_comm") - stop, 0.0), mean("bubble"), mean("other"))

    def _flush(self, trainer: Any) -> None:
        if not self._pending:
            return
        if trainer.is_global_zero and trainer.loggers:
            sums: dict[str, float] = {}
            for m in self._pending:
                for k, v in m.scalars().items():
                    sums[k] = sums.get(k, 0.0) + v
            mean = {k: v / len(self._pending) for k, v in sums.items() if math.isfinite(v)}
            for logger in trainer.loggers:
                logger.log_metrics(mean, step=trainer.global_step)
        self._pending = []

    @override
    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        t0 = time.perf_counter()
        if self._win is not None and self._win.active:  # an unfinished window (e.g. max_epochs ended it)
            self._win.discard()
            self._unread = [u[:4] + (False,) for u in self._unread]
        if self._counting is not None:
            self._counting.__exit__(None, None, None)
            self._counting = None
        self._read_steps(trainer)  # the last deferred GPU step
        self._flush(trainer)
        now = time.perf_counter()
        if self._prev_end is not None:  # after the last batch: its validation, checkpoint, the loop's end
            self._gap["profiler_overhead"] += now - t0
            named = {k: 1e3 * v for k, v in self._gap.items() if k in self._fit_between_ms}
            for k, v in named.items():
                self._fit_between_ms[k] += v
            self._fit_between_ms["other"] += max(1e3 * (now - self._prev_end) - sum(named.values()), 0.0)
            self._gap = dict.fromkeys(self._gap, 0.0)
            self._prev_end = None
        self._t_train_end = now
        self.fit_time_s = self._fit_summary()
        if trainer.is_global_zero and getattr(trainer, "loggers", None):  # where fit's time went (teardown: after)
            f = self.fit_time_s
            tags = {fit_tag(sec, k): v for sec in ("steps", "between_steps") for k, v in f[sec].items()}
            tags.update({fit_tag("wall", ""): f["wall"], fit_tag("accounted", ""): f["accounted"]})
            for logger in trainer.loggers:
                logger.log_metrics(tags, step=trainer.global_step)

    def _fit_summary(self) -> dict[str, Any]:
        """``fit`` as the monitor saw it (s): ``wall`` (setup hook → now), ``steps`` (:data:`STEP_PHASES`
        summed over the measured steps), ``between_steps`` (:data:`BETWEEN_STEPS_PARTS`) and ``accounted``
        (the two summed; equal to ``wall`` when nothing is missing or counted twice)."""
        wall = time.perf_counter() - self._t_fit0 if self._t_fit0 is not None else 0.0
        steps = {k: v / 1e3 for k, v in self._fit_steps_ms.items()}
        between = {k: v / 1e3 for k, v in self._fit_between_ms.items()}
        return {"wall": wall, "n_steps": self._fit_n_steps, "steps": steps, "between_steps": between,
                "accounted": sum(steps.values()) + sum(between.values())}
