"""Theoretical warp occupancy of Triton kernels on any NVIDIA target, computed without that GPU.

Layers, each importing only the ones before it:

* :mod:`~meshkit.profiling.occupancy.arch` — :data:`ARCHS` / :data:`GPUS`: per-architecture SM limits
  and SM counts per GPU model, each row citing its source; :func:`resolve_arch`.
* :mod:`~meshkit.profiling.occupancy.theory` — :func:`theoretical_occupancy`: CUDA's occupancy rules
  (``cuda_occupancy.h``), the limiter and what lifts it; :func:`grid_waves`.
* :mod:`~meshkit.profiling.occupancy.compile` — compiles a ``@triton.jit`` kernel for a target arch on
  this machine (Triton's CUDA backend and the ``ptxas``/``cuobjdump`` its wheel ships; no GPU needed)
  and reads registers, spills and shared memory from the cubin: one :class:`KernelResources` each.
* :mod:`~meshkit.profiling.occupancy.report` — :func:`kernel_occupancy` / :func:`sweep_occupancy`:
  :class:`KernelReport` (resources + occupancy + waves per GPU model), tables, TensorBoard, and the
  :class:`TritonKernelReport` Lightning callback.
* :mod:`~meshkit.profiling.occupancy.cli` — ``meshkit occupancy``: a table, ``--json`` or TensorBoard.

Nothing here imports triton until a kernel is compiled or the callback is installed.

>>> from meshkit.profiling.occupancy import theoretical_occupancy
>>> occ = theoretical_occupancy("sm_80", registers_per_thread=128, num_warps=4)
>>> occ.active_warps_per_sm, occ.occupancy, occ.limiter
(16, 0.25, 'registers')
"""

from __future__ import annotations

from meshkit.profiling.occupancy.arch import ARCHS, GPUS, ArchSpec, resolve_arch
from meshkit.profiling.occupancy.cli import configure_parser, run_cli
from meshkit.profiling.occupancy.compile import KernelCompileError, KernelResources
from meshkit.profiling.occupancy.report import (KernelReport, TritonKernelReport, kernel_occupancy,
                                                occupancy_markdown, occupancy_text, sweep_occupancy,
                                                write_occupancy_tensorboard)
from meshkit.profiling.occupancy.theory import (LIMITERS, GridWaves, Occupancy, grid_waves,
                                                theoretical_occupancy)

__all__ = [
    "ARCHS",
    "GPUS",
    "LIMITERS",
    "ArchSpec",
    "GridWaves",
    "KernelCompileError",
    "KernelReport",
    "KernelResources",
    "Occupancy",
    "TritonKernelReport",
    "grid_waves",
    "kernel_occupancy",
    "occupancy_markdown",
    "occupancy_text",
    "resolve_arch",
    "sweep_occupancy",
    "theoretical_occupancy",
    "write_occupancy_tensorboard",
    "configure_parser",
    "run_cli",
]
