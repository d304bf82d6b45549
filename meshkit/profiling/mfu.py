"""MFUMonitor: a Lightning callback for MFU, HFU, throughput and where the rest of the step went.

Per step (cheap: a few clock reads, one device sync on GPU) it measures the step's wall time
split into data-loader wait, forward + backward and optimizer step; every ``profile_every``
steps a short ``torch.profiler`` window adds what only a trace shows (exposed communication,
pipeline bubble, idle), and that window's ratios carry over to the following steps.

Definitions (numbers say what they count):

- ``mfu = model FLOPs / (step time · world size · peak)``; model FLOPs exclude recompute
  (PaLM's ``6N + 12·L·H·Q·T`` per token when the model's config is known, else 3 × the
  measured forward).
- ``hfu``: the same with hardware FLOPs, measured once by ``FlopCounterMode`` on a real step
  (activation recompute included), summed over all ranks.
- Tokens are counted once per data-parallel replica: the local batch's tokens × (dp_replicate ·
  dp_shard), read from ``trainer.strategy.parallel_dims.degrees`` when the strategy has one
  (tp, cp and pp ranks share a replica's tokens and its FLOPs), else × world size (plain DDP).
- The breakdown: ``compute + recompute + exposed_comm + bubble + data_wait + optimizer + other
  = 1`` (fractions of the step, each ≥ 0). Recompute gets the share of forward+backward
  compute time equal to its share of hardware FLOPs.

Example::

    >>> import lightning as L
    >>> from meshkit.profiling.mfu import MFUMonitor
    >>> trainer = L.Trainer(max_steps=1, callbacks=[MFUMonitor(profile_every=0)], logger=False,
    ...                     enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
"""

from __future__ import annotations

import glob
import math
import os
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from meshkit.modelspec import find_config
from meshkit.profiling.flops import flop_counter, model_flops_per_token, normalize_dtype, peak_info
from meshkit.profiling.report import BREAKDOWN_PARTS, SCALAR_PREFIX, points_lost, write_layout, write_window

__all__ = ["MFUMonitor", "StepMetrics", "mesh_factors", "batch_tokens", "split_step"]


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


def batch_tokens(batch: Any) -> int:
    """Tokens in one local batch: ``input_ids`` of a dict batch, else the first tensor's element count."""
    if isinstance(batch, torch.Tensor):
        return int(batch.numel())
    if isinstance(batch, Mapping):
        if "input_ids" in batch and isinstance(batch["input_ids"], torch.Tensor):
            return int(batch["input_ids"].numel())
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        for item in batch:
            if isinstance(item, torch.Tensor):
                return int(item.numel())
    raise ValueError(f"MFUMonitor: cannot count tokens in a batch of type {type(batch).__name__}; "
                     "pass `tokens_fn=lambda batch: <tokens in it>`.")


def _batch_seq_len(batch: Any) -> int | None:
    if isinstance(batch, Mapping):
        batch = batch.get("input_ids", next(iter(batch.values()), None))
    if isinstance(batch, (list, tuple)):
        batch = next((b for b in batch if isinstance(b, torch.Tensor)), None)
    return int(batch.shape[-1]) if isinstance(batch, torch.Tensor) and batch.dim() >= 1 else None


@dataclass
class _Window:
    """Per-step means of the latest profiled window (ms)."""

    step: int
    fwd_bwd_ms: float
    exposed_ms: float
    bubble_ms: float
    other_ms: float


def split_step(step_ms: float, data_ms: float, fwd_bwd_ms: float, optimizer_ms: float,
               window: _Window | None, recompute_share: float) -> dict[str, float]:
    """The step's wall time as fractions of the seven parts (≥ 0, summing to 1).

    Exposed comm, bubble and other idle come from the latest profiled window (scaled with the
    forward+backward time); what is left of forward+backward is compute, of which
    ``recompute_share`` is recompute.
    """
    parts = dict.fromkeys(BREAKDOWN_PARTS, 0.0)
    if step_ms <= 0:
        return parts
    fb = max(fwd_bwd_ms, 0.0)
    lost = [0.0, 0.0, 0.0]
    if window is not None and window.fwd_bwd_ms > 0:
        scale = fb / window.fwd_bwd_ms
        lost = [window.exposed_ms * scale, window.bubble_ms * scale, window.other_ms * scale]
        if sum(lost) > fb:
            lost = [x * fb / sum(lost) for x in lost]
    rest = fb - sum(lost)
    ms = {"compute": rest * (1 - recompute_share), "recompute": rest * recompute_share,
          "exposed_comm": lost[0], "bubble": lost[1], "data_wait": max(data_ms, 0.0),
          "optimizer": max(optimizer_ms, 0.0)}
    ms["other"] = max(step_ms - sum(ms.values()), 0.0)  # the window's idle (lost[2]) + any timer gap
    total = sum(ms.values())
    return {k: v / total for k, v in ms.items()} if total > 0 else parts


@dataclass
class StepMetrics:
    """What MFUMonitor computed for one step (also logged under ``mfu/``)."""

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
        p = SCALAR_PREFIX
        out = {f"{p}/mfu": self.mfu, f"{p}/hfu": self.hfu, f"{p}/tflops_per_device": self.tflops_per_device,
               f"{p}/hardware_tflops_per_device": self.hardware_tflops_per_device,
               f"{p}/tokens_per_s": self.tokens_per_s, f"{p}/tokens_per_s_per_device": self.tokens_per_s_per_device,
               f"{p}/step_time_ms": 1e3 * self.step_time_s}
        out.update({f"{p}/breakdown/{k}": v for k, v in self.breakdown.items()})
        lost = points_lost(self.breakdown, self.mfu)
        out.update({f"{p}/points_lost/{k}": v for k, v in lost.items() if k != "ideal"})
        return out


# --------------------------------------------------------------------------------- callback


class _Clock:
    """One step's phase stamps: CUDA events on GPU, perf_counter on CPU.

    A GPU step's events are read one step late (``deferred``): by the end of the next step the
    host has queued that step's work behind them, so waiting on them never drains the device.
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.deferred = self.cuda
        self.marks: dict[str, Any] = {}

    def phases_ms(self) -> tuple[float, float]:
        """(forward+backward, optimizer) in ms: start → opt → end, or start → end without an optimizer mark."""
        if "opt" in self.marks:
            return self.ms("start", "opt"), self.ms("opt", "end")
        return self.ms("start", "end"), 0.0

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
        seq_len: T for the attention term; default the batch's last dimension.
        tokens_fn: ``batch -> tokens`` in one local batch; default :func:`batch_tokens`.
        measure_flops: count hardware FLOPs with ``FlopCounterMode`` on training batch
            ``flop_count_batch`` (that step is not timed).
        profile_every: a torch.profiler window every this many batches (0: never).
        profile_start: batch index of the first window.
        profile_steps: active steps per window (after one warm-up step).
        profile_budget: the largest share of training time the profiler windows may take (default
            0.5 %, so that with the per-step timers the monitor stays under 1 %). Each
            window's cost is measured (its steps' slow-down, trace export, analysis and TensorBoard
            writing, the slowest rank's) and the next window waits at least
            ``cost / (profile_budget · step time)`` batches, never fewer than ``profile_every``.
            ``None``: a window every ``profile_every`` batches whatever it costs.
        log_every: log scalars every this many batches (default: the Trainer's log_every_n_steps).
        trace_dir: where traces go (default ``<log_dir>/profiler``, which TensorBoard's
            pytorch_profiler tab reads).

    Example::

        trainer = L.Trainer(callbacks=[MFUMonitor(profile_every=200)])
    """

    def __init__(self, *, peak_flops: float | None = None, dtype: Any = None, flops_per_token: float | None = None,
                 seq_len: int | None = None, tokens_fn: Callable[[Any], int] | None = None,
                 measure_flops: bool = True, flop_count_batch: int = 1, profile_every: int = 100,
                 profile_start: int = 5, profile_steps: int = 2, profile_budget: float | None = 0.005,
                 log_every: int | None = None,
                 trace_dir: str | None = None, history: int = 10_000) -> None:
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
        self._fwd_flops = 0.0
        self._counted_step = False
        self._model_per_token: float | None = None  # global model FLOPs per global token
        self._hw_factor = 1.0
        self._fwd_model_per_token: float | None = None
        self.measured_flops: dict[str, float] = {}
        self._recompute_share = 0.0
        self._prof: Any = None
        self._prof_steps = 0
        self._prof_first = 0
        self._next_window = self.profile_start
        self._window_t0 = 0.0
        self.profile_windows: list[dict[str, float]] = []
        self._window_data_ms: list[float] = []
        self._window_fb_ms: list[float] = []
        self._pending: list[StepMetrics] = []
        self._unread: list[tuple[int, float, float, _Clock, bool]] = []
        self._plain_step_s: deque[float] = deque(maxlen=64)  # recent steps outside profiler windows
        self._log_dir: str | None = None

    # ------------------------------------------------------------------ setup

    @override
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit":
            return
        self._reset()
        self._dp, self._world = mesh_factors(trainer.strategy, trainer.world_size)
        self._device = pl_module.device if pl_module.device.type != "meta" else torch.device("cpu")
        self._log_dir = trainer.log_dir  # collective: every rank calls setup
        if self.trace_dir is None:
            self.trace_dir = os.path.join(self._log_dir or trainer.default_root_dir, "profiler")
        self._rank = trainer.global_rank
        if self.log_every is None:
            self.log_every = max(int(getattr(trainer, "log_every_n_steps", 50) or 1), 1)
        dtype = self.dtype if self.dtype is not None else self._precision_dtype(trainer)
        if self.peak_flops is not None:
            self._peak, self.peak_source = float(self.peak_flops), "override"
        else:
            name = torch.cuda.get_device_name(self._device) if self._device.type == "cuda" else "cpu"
            info = peak_info(name, dtype)
            self._peak, self.peak_source = info.flops, f"{info.kind}: {info.row} {info.dtype} ({info.source})"
        if trainer.is_global_zero and self.profile_every:
            writer = self._writer(trainer)
            if writer is not None:
                write_layout(writer)

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

    @override
    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        self._prev_end = time.perf_counter()

    @override
    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._t_start = time.perf_counter()
        self._clock = _Clock(self._device)
        self._clock.mark("start")
        b = self._batches
        if self.profile_every and b >= self._next_window and self._prof is None and b != self.flop_count_batch \
                and self._window_fits(trainer):
            self._window_t0 = time.perf_counter()
            self._start_window()
        if self.measure_flops and b == self.flop_count_batch and self._prof is None:
            self._counting = flop_counter()
            self._counting.__enter__()
        if self._model_per_token is None and (b > self.flop_count_batch or not self.measure_flops):
            self._resolve_flops(trainer, pl_module, batch)
        self._batch = batch

    @override
    def on_before_backward(self, trainer: Any, pl_module: Any, loss: torch.Tensor) -> None:
        if self._counting is not None:
            self._fwd_flops = float(self._counting.get_total_flops())

    @override
    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if self._clock is not None:
            self._clock.mark("opt")
        if self._counting is not None:
            total = float(self._counting.get_total_flops())
            self._counting.__exit__(None, None, None)
            self._counting = None
            self._finish_count(trainer, pl_module, total)

    @override
    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        clock = self._clock
        if self._counting is not None:  # manual optimization without on_before_optimizer_step
            total = float(self._counting.get_total_flops())
            self._counting.__exit__(None, None, None)
            self._counting = None
            self._finish_count(trainer, pl_module, total)
        if clock is not None:
            clock.mark("end")
        now = time.perf_counter()
        data_ms = 1e3 * (self._t_start - self._prev_end) if self._prev_end is not None else 0.0
        self._prev_end = now
        b = self._batches
        self._batches += 1
        in_window = self._prof is not None
        if self._prof is not None:
            self._window_data_ms.append(data_ms)
            self._window_fb_ms.append(clock.phases_ms()[0] if clock else 0.0)  # a sync: the window profiles anyway
            self._prof.step()
            self._prof_steps += 1
            if self._prof_steps >= 1 + self.profile_steps:
                self._end_window(trainer, b)
        if clock is not None and not (b == self.flop_count_batch and self.measure_flops):
            # (the FLOP-counted step is slow by design: not a measurement)
            self._unread.append((b, self._global_tokens(batch), data_ms, clock, in_window))
        self._read_steps(trainer, keep=1 if clock is not None and clock.deferred else 0)

    def _read_steps(self, trainer: Any, keep: int = 0) -> None:
        """Record the steps whose clocks are read, leaving the newest ``keep`` (deferred GPU reads)."""
        while len(self._unread) > keep:
            b, tokens, data_ms, clock, in_window = self._unread.pop(0)
            fb_ms, opt_ms = clock.phases_ms()
            step_ms = data_ms + fb_ms + opt_ms
            if not in_window:
                self._plain_step_s.append(step_ms / 1e3)
            if self._model_per_token is not None and step_ms > 0:
                self._record(trainer, b, tokens, step_ms, data_ms, fb_ms, opt_ms)

    # ------------------------------------------------------------------ FLOPs

    def _global_tokens(self, batch: Any) -> float:
        return float(self.tokens_fn(batch)) * self._dp

    def _resolve_flops(self, trainer: Any, pl_module: Any, batch: Any) -> None:
        if self.flops_per_token is not None:
            self._model_per_token = float(self.flops_per_token)
        else:
            cfg = find_config(pl_module)
            if cfg is not None:
                try:
                    self._model_per_token = model_flops_per_token(cfg, seq_len=self.seq_len or _batch_seq_len(batch))
                except ValueError:
                    self._model_per_token = None
        if self._model_per_token is None:
            self._model_per_token = self._fwd_model_per_token
        if self._model_per_token is None:
            raise ValueError(
                "MFUMonitor: cannot tell the model's FLOPs: the module has no `config` (HF, torchtitan args or "
                "meshkit LlamaConfig) and `measure_flops=False`. Pass `flops_per_token=` or enable measure_flops."
            )

    def _finish_count(self, trainer: Any, pl_module: Any, total_local: float) -> None:
        local = torch.tensor([self._fwd_flops, total_local], dtype=torch.float64)
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

    def _start_window(self) -> None:
        from torch.profiler import ProfilerActivity, profile, schedule

        activities = [ProfilerActivity.CPU]
        if self._device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        os.makedirs(self.trace_dir, exist_ok=True)
        self._prof_first = self._batches
        self._prof = profile(activities=activities, schedule=schedule(wait=0, warmup=1, active=self.profile_steps,
                                                                      repeat=1),
                             on_trace_ready=self._save_trace, record_shapes=False, with_stack=False)
        self._prof_steps = 0
        self._window_data_ms, self._window_fb_ms = [], []
        self._prof.start()

    def _trace_path(self, first: int) -> str:
        return os.path.join(self.trace_dir, f"rank{self._rank}.{first}.pt.trace.json")

    def _save_trace(self, prof: Any) -> None:
        prof.export_chrome_trace(self._trace_path(self._prof_first))

    def _end_window(self, trainer: Any, batch_idx: int) -> None:
        self._prof.stop()
        self._prof = None
        window = self._analyze_window(self._trace_path(self._prof_first))
        if window is not None:
            self.windows.append(window)
        trainer.strategy.barrier("meshkit_mfu_window")  # every rank's trace of this window is on disk
        if trainer.is_global_zero:
            self._write_window(trainer, self._prof_first)
        # after rank 0's writing, which every rank would wait for at its next collective anyway
        self._schedule_next_window(trainer)

    def _schedule_next_window(self, trainer: Any) -> None:
        """Measure what this window cost and agree with every rank on the batch of the next one."""
        recent = sorted(self._plain_step_s or [m.step_time_s for m in list(self.history)[-64:]])
        step_s = recent[len(recent) // 2] if recent else 0.0
        cost = time.perf_counter() - self._window_t0 - (1 + self.profile_steps) * step_s
        agreed = torch.tensor([max(cost, 0.0), step_s], dtype=torch.float64)
        if self._world > 1:
            dev = self._device if self._device.type == "cuda" else torch.device("cpu")
            agreed = trainer.strategy.reduce(agreed.to(dev), reduce_op="max").cpu()
        cost, step_s = float(agreed[0]), float(agreed[1])
        gap = self.profile_every
        if self.profile_budget is not None and step_s > 0:
            gap = max(gap, math.ceil(cost / (self.profile_budget * step_s)))
        self._next_window = self._prof_first + gap
        self.profile_windows.append({"batch": self._prof_first, "cost_s": cost, "step_s": step_s,
                                     "next_batch": self._next_window})

    def _analyze_window(self, path: str) -> _Window | None:
        from meshkit.profiling.overlap import rank_step_metrics
        from meshkit.profiling.trace import _build, load_trace

        if not os.path.exists(path):
            return None
        sink, meta, problems = load_trace(path)
        rt = _build(self._rank, [path], [sink], [meta], problems)
        if rt.step_windows.shape[0] == 0:
            return None
        m = rank_step_metrics(rt)
        n = rt.step_windows.shape[0]
        mean = lambda k: float(m[k].sum()) / n / 1e3 if k in m else 0.0  # noqa: E731  µs -> ms
        bubble = mean("bubble")
        tl_bubble = self._timeline_bubble_ms()
        if tl_bubble is not None:
            bubble = tl_bubble
        active_data = self._window_data_ms[1:] or self._window_data_ms
        active_fb = self._window_fb_ms[1:] or self._window_fb_ms
        data = sum(active_data) / max(len(active_data), 1)
        fb = sum(active_fb) / max(len(active_fb), 1)
        other = max(mean("idle") - bubble - data, 0.0)
        return _Window(self._prof_first, fb, mean("exposed_comm"), bubble, other)

    def _timeline_bubble_ms(self) -> float | None:
        from meshkit.profiling.bubble import find_timeline_dir, read_timeline

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
        from meshkit.profiling.bubble import measured_bubble

        m = measured_bubble([r for r in records if r.step in steps])
        rank = m.per_rank.get(self._rank)
        return rank.idle_ns / 1e6 / len(steps) if rank else None

    def _write_window(self, trainer: Any, first: int) -> None:
        writer = self._writer(trainer)
        if writer is None or not self.history:
            return
        from meshkit.profiling.overlap import analyze

        files = sorted(glob.glob(os.path.join(self.trace_dir, f"rank*.{first}.pt.trace.json")))
        try:
            overlap = analyze(files) if files else None
        except ValueError:
            overlap = None
        gantt = None
        try:
            from meshkit.profiling.bubble import find_timeline_dir, gantt_figure, read_timeline

            tdir = find_timeline_dir(self._log_dir) if self._log_dir else None
            if tdir:
                gantt = gantt_figure(read_timeline(tdir), title=f"pipeline timeline (last step before {first})")
        except ValueError:
            gantt = None
        last = self.history[-1]
        write_window(writer, trainer.global_step, last.breakdown, last.mfu, last.step_time_s, overlap, gantt)

    # ------------------------------------------------------------------ metrics

    def _record(self, trainer: Any, b: int, tokens: float, step_ms: float, data_ms: float, fb_ms: float,
                opt_ms: float) -> None:
        t = step_ms / 1e3
        model = self._model_per_token * tokens
        hw = model * self._hw_factor
        denom = t * self._world * self._peak
        window = self.windows[-1] if self.windows else None
        metrics = StepMetrics(
            step=b, step_time_s=t, mfu=model / denom, hfu=hw / denom,
            tflops_per_device=model / self._world / t / 1e12, hardware_tflops_per_device=hw / self._world / t / 1e12,
            tokens_per_s=tokens / t, tokens_per_s_per_device=tokens / t / self._world,
            breakdown=split_step(step_ms, data_ms, fb_ms, opt_ms, window, self._recompute_share),
        )
        self.history.append(metrics)
        self._pending.append(metrics)
        if len(self._pending) >= (self.log_every or 1):
            self._flush(trainer)

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
        if self._prof is not None:  # an unfinished window (e.g. max_epochs ended it): drop its trace
            self._prof.stop()
            self._prof = None
            path = self._trace_path(self._prof_first)
            if os.path.exists(path):
                os.remove(path)
        if self._counting is not None:
            self._counting.__exit__(None, None, None)
            self._counting = None
        self._read_steps(trainer)  # the last deferred GPU step
        self._flush(trainer)
