"""meshkit.profiling: everything that measures (it never imports meshkit.plugins).

- :mod:`~meshkit.profiling.flops`: peak FLOP/s table, model FLOPs per token, measured step FLOPs.
- :mod:`~meshkit.profiling.mfu`: the ``MFUMonitor`` Lightning callback.
- :mod:`~meshkit.profiling.trace` / :mod:`~meshkit.profiling.overlap`: ``meshkit analyze``.
- :mod:`~meshkit.profiling.bubble`: ``meshkit bubble``, the pipeline timeline record.
- :mod:`~meshkit.profiling.report`: TensorBoard layout, tables, figures.

Submodules are imported lazily so ``meshkit analyze`` does not pay for Lightning.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "MFUMonitor",
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

_WHERE = {
    "MFUMonitor": "mfu",
    "peak_flops": "flops",
    "model_flops_per_token": "flops",
    "measure_step_flops": "flops",
    "analyze": "overlap",
    "theoretical_bubble": "bubble",
    "simulate": "bubble",
    "measured_bubble": "bubble",
    "read_timeline": "bubble",  # re-exported from meshkit.timeline
    "TimelineRecord": "bubble",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(f"meshkit.profiling.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'meshkit.profiling' has no attribute {name!r}")
