"""FabricMFU: :class:`~meshkit.profiling.mfu.MFUMonitor` for a hand-written Lightning Fabric loop.

The loop calls it per step; underneath it is the Trainer's MFUMonitor itself (its clocks, FLOP counting,
profiler windows, breakdown and TensorBoard tags, :mod:`meshkit.profiling.report`), driven through a view of
the Fabric that answers what the monitor reads of a Trainer (strategy and its ``parallel_dims``, ranks,
loggers, precision, step). So a Fabric run and a Trainer run write the same tags with the same definitions.

Example::

    >>> fabric = L.Fabric(strategy="hsdp_tp", loggers=TensorBoardLogger("runs"))  # doctest: +SKIP
    >>> fabric.launch(); model, optimizer = fabric.setup(model, optimizer)  # doctest: +SKIP
    >>> mfu = FabricMFU(fabric, model, profile_every=100)  # doctest: +SKIP
    >>> for batch in loader:  # doctest: +SKIP
    ...     with mfu.step(batch):
    ...         fabric.backward(loss_fn(model, batch))
    ...         mfu.before_optimizer_step()  # optional: splits forward+backward from the optimizer
    ...         optimizer.step(); optimizer.zero_grad()
    >>> mfu.close()  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator

import torch
from torch import nn

from meshkit.profiling.mfu import MFUMonitor, StepMetrics

__all__ = ["FabricMFU"]


class _Collectives:
    """The Trainer strategy's calls MFUMonitor makes (``reduce``, ``barrier``, ``broadcast``, ``parallel_dims``,
    ``device_mesh``), on a Fabric."""

    def __init__(self, fabric: Any) -> None:
        self._fabric = fabric

    @property
    def parallel_dims(self) -> Any:
        return getattr(self._fabric.strategy, "parallel_dims", None)  # meshkit's strategy; None: plain DDP

    def reduce(self, tensor: torch.Tensor, reduce_op: str = "sum") -> torch.Tensor:
        return self._fabric.all_reduce(tensor, reduce_op=reduce_op)

    def barrier(self, name: str | None = None) -> None:
        self._fabric.barrier(name)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return self._fabric.broadcast(obj, src=src)

    @property
    def device_mesh(self) -> Any:
        return getattr(self._fabric.strategy, "device_mesh", None)  # meshkit's strategy; None: plain DDP


class _FabricRun:
    """What MFUMonitor reads of a Trainer, answered by a Fabric (the step is counted by :class:`FabricMFU`)."""

    sanity_checking = False

    def __init__(self, fabric: Any, max_steps: int, log_every: int) -> None:
        self.strategy = _Collectives(fabric)
        self.world_size, self.global_rank, self.is_global_zero = fabric.world_size, fabric.global_rank, fabric.is_global_zero
        self.loggers = list(fabric.loggers)
        self.precision = str(getattr(fabric.strategy.precision, "precision", "32-true"))
        self.max_steps, self.log_every_n_steps, self.global_step = max_steps, log_every, 0
        self.default_root_dir = os.getcwd()
        log_dir = getattr(self.loggers[0], "log_dir", None) if self.loggers else None
        self.log_dir = fabric.broadcast(log_dir)  # every rank writes its traces under rank 0's folder


class FabricMFU:
    """Log MFU, HFU, TFLOP/s per device, tokens/s and the MFU breakdown of a Fabric loop to its TensorBoard logger.

    Args:
        fabric: a launched ``lightning.fabric.Fabric``; scalars go to its loggers (rank 0), traces under its first
            logger's ``log_dir``.
        model: the set-up model (its config gives the model FLOPs; see :class:`MFUMonitor`'s ``flops_per_token``).
        max_steps: the loop's length, if known (a profiler window is never started that the loop cannot finish).
        log_every: log the mean scalars every this many steps.
        monitor: every other option of :class:`~meshkit.profiling.mfu.MFUMonitor` (``peak_flops``, ``profile_every``,
            ``tokens_fn``, ``measure_flops``, ...), the same meaning.

    The loop's checkpointing (``fabric.save``) is timed as the ``checkpoint`` bucket; wrap validation in
    ``with mfu.phase("validation"):``. Metrics of each step: :attr:`history`.
    """

    def __init__(self, fabric: Any, model: nn.Module, *, max_steps: int = -1, log_every: int = 50,
                 **monitor: Any) -> None:
        self.monitor = MFUMonitor(**monitor)
        self._fabric, self._run = fabric, _FabricRun(fabric, max_steps, log_every)
        self._module: nn.Module = getattr(model, "module", model)  # a _FabricModule's original module
        device = fabric.device
        self.monitor.begin(self._run, device if device.type != "meta" else torch.device("cpu"), save=(fabric, "save"))
        self._started = False

    @property
    def history(self) -> Any:
        """Every measured step's :class:`~meshkit.profiling.mfu.StepMetrics` (the FLOP-counted step is not one)."""
        return self.monitor.history

    @property
    def last(self) -> StepMetrics | None:
        return self.monitor.history[-1] if self.monitor.history else None

    @contextlib.contextmanager
    def step(self, batch: Any) -> Iterator[None]:
        """One training step: forward, backward and the optimizer step run inside (``batch``: the local batch)."""
        run = self._run
        if not self._started:
            self.monitor.on_train_epoch_start(run, self._module)
            self._started = True
        self.monitor.on_train_batch_start(run, self._module, batch, run.global_step)
        yield
        self.monitor.on_train_batch_end(run, self._module, None, batch, run.global_step)
        run.global_step += 1

    def before_optimizer_step(self) -> None:
        """Mark the end of forward+backward (optional; without it the optimizer counts as forward+backward)."""
        self.monitor.on_before_optimizer_step(self._run, self._module, None)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time a part of the loop between steps as its bucket: ``"validation"`` or ``"checkpoint"``."""
        if name not in ("validation", "checkpoint"):
            raise ValueError(f"FabricMFU.phase: `name={name!r}` must be 'validation' or 'checkpoint'.")
        self.monitor._phase_begin(name)
        try:
            yield
        finally:
            self.monitor._phase_end(name)

    def close(self) -> None:
        """End of training: the last steps are logged, an unfinished profiler window dropped, ``fabric.save`` restored."""
        self.monitor.on_train_end(self._run, self._module)
        self.monitor.teardown(self._run, self._module, "fit")
