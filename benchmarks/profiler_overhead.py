"""MFUMonitor overhead: step time of a small Lightning run with vs without the callback.

Runs alternate (without, with, without, with, ...) in one process so machine load hits both
alike; the figures are the median per-step wall time and per-step process CPU time (the
monitor's own work; robust when other jobs share the cores) over each run's timed steps.

    python benchmarks/profiler_overhead.py --steps 60 --repeats 3 [--profile-every 0]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402

from meshkit.models import LlamaConfig, LlamaLM, synthetic_tokens  # noqa: E402
from meshkit.profiling.mfu import MFUMonitor  # noqa: E402


class _StepTimer(Callback):
    """The reference clocks between consecutive batch ends: wall time, and this process's CPU
    time (what the monitor's own work costs; robust when other jobs share the cores)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.cpu: list[float] = []
        self._last = None

    def on_train_batch_end(self, *args, **kwargs) -> None:
        now, cpu = time.perf_counter(), time.process_time()
        if self._last is not None:
            self.times.append(now - self._last[0])
            self.cpu.append(cpu - self._last[1])
        self._last = (now, cpu)


def one_run(with_monitor: bool, steps: int, profile_every: int, root: str, dim: int) -> tuple[float, float]:
    torch.manual_seed(0)
    cfg = LlamaConfig.tiny(dim=dim, n_heads=4, n_kv_heads=2)
    loader = torch.utils.data.DataLoader(synthetic_tokens(steps * 4, 64, cfg.vocab_size), batch_size=4)
    timer = _StepTimer()
    callbacks = [timer] + ([MFUMonitor(profile_every=profile_every, profile_start=10, log_every=10)]
                           if with_monitor else [])
    from lightning.pytorch.loggers import TensorBoardLogger

    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=TensorBoardLogger(root),
                        callbacks=callbacks, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, log_every_n_steps=10)
    trainer.fit(LlamaLM(cfg), loader)
    return statistics.median(timer.times[5:]), statistics.median(timer.cpu[5:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--profile-every", type=int, default=0, help="0: timers only; N: a trace window every N")
    ap.add_argument("--root", default="/tmp/meshkit_overhead")
    args = ap.parse_args()
    torch.set_num_threads(1)
    base, mon = [], []
    for _ in range(args.repeats):
        base.append(one_run(False, args.steps, args.profile_every, args.root, args.dim))
        mon.append(one_run(True, args.steps, args.profile_every, args.root, args.dim))
    for i, clock in enumerate(("wall", "CPU")):
        b = statistics.median(x[i] for x in base)
        m = statistics.median(x[i] for x in mon)
        print(f"[{clock}] median step without MFUMonitor: {1e3 * b:.3f} ms (runs {[round(1e3 * x[i], 3) for x in base]})")
        print(f"[{clock}] median step with    MFUMonitor: {1e3 * m:.3f} ms (runs {[round(1e3 * x[i], 3) for x in mon]})")
        print(f"[{clock}] overhead: {100 * (m - b) / b:+.2f} % of step time (target <= 1 %)")


if __name__ == "__main__":
    main()
