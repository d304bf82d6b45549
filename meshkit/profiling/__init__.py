"""meshkit.profiling: everything that measures (it never imports meshkit.plugins).

- :mod:`~meshkit.profiling.flops`: peak FLOP/s table, model FLOPs per token, measured step FLOPs.
- :mod:`~meshkit.profiling.mfu`: the ``MFUMonitor`` Lightning callback.
- :mod:`~meshkit.profiling.fabric`: ``FabricMFU``, the same monitor called per step from a Fabric loop.
- :mod:`~meshkit.profiling.trace` / :mod:`~meshkit.profiling.overlap`: ``meshkit analyze``.
- :mod:`~meshkit.profiling.bubble`: ``meshkit bubble``, the pipeline timeline record.
- :mod:`~meshkit.profiling.report`: TensorBoard layout, tables, figures.

Names and submodules load on first use (:mod:`meshkit.lazy`) so ``meshkit analyze`` does not pay for Lightning.
"""

from __future__ import annotations

from meshkit.lazy import lazy_names as _lazy_names

__all__ = [
    "MFUMonitor",
    "FabricMFU",
    "peak_flops",
    "model_flops_per_token",
    "measure_step_flops",
    "analyze",
    "theoretical_bubble",
    "simulate",
    "measured_bubble",
    "read_timeline",
    "TimelineRecord",
]

_WHERE: dict[str, str] = {  # public name -> the module that owns it
    "MFUMonitor": "meshkit.profiling.mfu",
    "FabricMFU": "meshkit.profiling.fabric",
    "peak_flops": "meshkit.profiling.flops",
    "model_flops_per_token": "meshkit.profiling.flops",
    "measure_step_flops": "meshkit.profiling.flops",
    "analyze": "meshkit.profiling.overlap",
    "theoretical_bubble": "meshkit.profiling.bubble",
    "simulate": "meshkit.profiling.bubble",
    "measured_bubble": "meshkit.profiling.bubble",
    "read_timeline": "meshkit.profiling.bubble",  # re-exported from meshkit.timeline
    "TimelineRecord": "meshkit.profiling.bubble",
}


__getattr__, __dir__ = _lazy_names(__name__, _WHERE)
