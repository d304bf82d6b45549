"""MFUMonitor overhead: what the callback adds to a small Lightning run's step time.

Two measurements, both in one invocation:

1. **Accounted** (robust on a loaded machine): every MFUMonitor hook is wrapped in a timer, so
   the time spent inside the callback in each step is known exactly; steps touched by a
   torch.profiler window (recorded ops run slower; export, analysis and writing) count as their
   time minus the median plain step. Overhead = that sum ÷ (run time − that sum). The same in
   CPU time (the hooks' thread CPU; the window steps' process CPU minus the median plain step's),
   which other processes on a shared machine disturb far less than wall time.
2. **A/B** (the direct comparison): runs alternate without / with the monitor in one process
   so machine load hits both alike; medians of per-step wall time and per-step process CPU
   time, and the whole fit's wall time.

Each is given for three settings: timers only (``profile_every=0``: what every step pays),
windows every 100 batches under the default ``profile_budget=0.005``, and windows every 100
batches with no budget.

    python benchmarks/profiler_overhead.py --steps 300 --repeats 3
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402
from lightning.pytorch.loggers import TensorBoardLogger  # noqa: E402

from meshkit.models import LlamaConfig, LlamaLM, synthetic_tokens  # noqa: E402
from meshkit.profiling.mfu import MFUMonitor  # noqa: E402

_HOOKS = ("setup", "on_train_epoch_start", "on_train_batch_start", "on_before_backward", "on_before_optimizer_step",
          "on_validation_start", "on_validation_end",
          "on_train_batch_end", "on_train_end")


class _StepTimer(Callback):
    """Wall and process-CPU time between consecutive batch ends, and the monitor's hook time in each."""

    def __init__(self, hook_acc: list[float]) -> None:
        self.times: list[float] = []
        self.cpu: list[float] = []
        self.hooks: list[float] = []
        self.hooks_cpu: list[float] = []
        self._acc = hook_acc
        self._last: tuple[float, float] | None = None

    def on_train_batch_end(self, *args, **kwargs) -> None:
        now, cpu = time.perf_counter(), time.process_time()
        if self._last is not None:
            self.times.append(now - self._last[0])
            self.cpu.append(cpu - self._last[1])
            self.hooks.append(self._acc[0])
            self.hooks_cpu.append(self._acc[1])
        self._acc[0] = self._acc[1] = 0.0
        self._last = (now, cpu)


def _timed(monitor: MFUMonitor, acc: list[float]) -> None:
    """Wrap the monitor's hooks so that the wall (CPU) seconds spent in them accumulate in ``acc[0]`` (``acc[1]``)."""
    for name in _HOOKS:
        hook = getattr(monitor, name)

        @functools.wraps(hook)
        def wrapper(*args, _hook=hook, **kwargs):
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return _hook(*args, **kwargs)
            finally:
                acc[0] += time.perf_counter() - t0
                acc[1] += time.thread_time() - c0

        setattr(monitor, name, wrapper)


def one_run(with_monitor: bool, steps: int, every: int, budget: float | None, root: str, dim: int) -> dict:
    torch.manual_seed(0)
    cfg = LlamaConfig.tiny(dim=dim, n_heads=4, n_kv_heads=2)
    loader = torch.utils.data.DataLoader(synthetic_tokens(steps * 4, 64, cfg.vocab_size), batch_size=4)
    acc = [0.0, 0.0]
    timer = _StepTimer(acc)
    monitor = None
    if with_monitor:
        monitor = MFUMonitor(profile_every=every, profile_start=10, profile_budget=budget)  # logs every 50
        _timed(monitor, acc)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=TensorBoardLogger(root),
                        callbacks=[timer] + ([monitor] if monitor else []), enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=50)
    t0 = time.perf_counter()
    trainer.fit(LlamaLM(cfg), loader)
    fit_s = time.perf_counter() - t0
    # times[i]: batch i+1, from batch i's end to batch i+1's end. The monitor's hooks for batch B's end
    # run after the timer's, so they land in times[B]. A window of batches B..B+k touches times[B-1..B+k].
    # Skip warm-up and the FLOP-counted batch 1 (a one-off at start-up).
    timed = range(5, len(timer.times))
    window: set[int] = set()
    for w in (monitor.profile_windows if monitor else []):
        window.update(range(int(w["batch"]) - 1, int(w["batch"]) + 1 + monitor.profile_steps))
    plain = [timer.times[i] for i in timed if i not in window]
    median = statistics.median(plain)
    extra = sum(timer.times[i] - median if i in window else timer.hooks[i] for i in timed)
    median_cpu = statistics.median(timer.cpu[i] for i in timed if i not in window)
    extra_cpu = sum(timer.cpu[i] - median_cpu if i in window else timer.hooks_cpu[i] for i in timed)
    plain_hooks = [timer.hooks[i] for i in timed if i not in window]
    return {"step_s": median, "cpu_s": median_cpu,
            "fit_s": fit_s, "overhead_pct": 100 * extra / (sum(timer.times[i] for i in timed) - extra),
            "overhead_cpu_pct": 100 * extra_cpu / (sum(timer.cpu[i] for i in timed) - extra_cpu),
            "window_s": sum(timer.times[i] - median for i in timed if i in window),
            "hook_us": 1e6 * statistics.median(plain_hooks), "hook_mean_us": 1e6 * statistics.mean(plain_hooks),
            "hook_cpu_us": 1e6 * statistics.mean(timer.hooks_cpu[i] for i in timed if i not in window),
            "windows": len(monitor.profile_windows) if monitor else 0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--root", default="/tmp/meshkit_overhead")
    ap.add_argument("--only", type=int, nargs="+", default=None, help="run only these settings (0, 1, 2)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    configs = [("timers only (profile_every=0)", 0, None), ("windows, default budget 0.5 %", 100, 0.005),
               ("a window every 100 batches, no budget", 100, None)]
    for label, every, budget in [c for i, c in enumerate(configs) if args.only is None or i in args.only]:
        base, mon = [], []
        for _ in range(args.repeats):
            base.append(one_run(False, args.steps, every, budget, args.root, args.dim))
            mon.append(one_run(True, args.steps, every, budget, args.root, args.dim))
        print(f"== {label}: {args.steps} steps, {args.repeats} runs each, dim {args.dim}")
        acc = [m["overhead_pct"] for m in mon]
        cpu = [m["overhead_cpu_pct"] for m in mon]
        print(f"  accounted overhead: {statistics.median(acc):.3f} % of step time (runs {[round(a, 3) for a in acc]});"
              f" in CPU time {statistics.median(cpu):.3f} % (runs {[round(a, 3) for a in cpu]})")
        print(f"  hooks per plain step: median {statistics.median(m['hook_us'] for m in mon):.0f} us,"
              f" mean {statistics.median(m['hook_mean_us'] for m in mon):.0f} us wall,"
              f" mean {statistics.median(m['hook_cpu_us'] for m in mon):.0f} us CPU;"
              f" windows per run {[m['windows'] for m in mon]}, their cost {[round(m['window_s'], 3) for m in mon]} s")
        for key, name in (("step_s", "wall per step"), ("cpu_s", "CPU per step"), ("fit_s", "whole fit")):
            b = statistics.median(x[key] for x in base)
            m = statistics.median(x[key] for x in mon)
            print(f"  A/B {name:>13}: without {1e3 * b:9.3f} ms, with {1e3 * m:9.3f} ms -> {100 * (m - b) / b:+.2f} %"
                  f"  (runs without {[round(1e3 * x[key], 2) for x in base]}, with {[round(1e3 * x[key], 2) for x in mon]})")
    print("target: <= 1 % of step time")


if __name__ == "__main__":
    main()
