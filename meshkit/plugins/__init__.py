"""meshkit.plugins: everything that changes how a model is trained.

Its public names load their modules on first use (PEP 562, as ``meshkit``'s own): ``meshkit plan``
(``meshkit.plugins.planner``: numpy only) does not pay seconds for torch and Lightning, which
``meshkit.plugins.strategy`` imports.
"""

from __future__ import annotations

import importlib
from typing import Any

# public name -> the module that owns it. ``parallelize`` (the function) is not re-exported here:
# ``meshkit.plugins.parallelize`` stays the module.
_WHERE: dict[str, str] = {
    "NDParallelStrategy": "meshkit.plugins.strategy",
    "register_presets": "meshkit.plugins.strategy",
    "ParallelDims": "meshkit.plugins.dims",
    "ParallelConfig": "meshkit.plugins.parallelize",
    "PRESETS": "meshkit.plugins.presets",
    "Preset": "meshkit.plugins.presets",
    "apply_context_parallel": "meshkit.plugins.context_parallel",
    "context_parallel_attention": "meshkit.plugins.context_parallel",
    "shard_batch": "meshkit.plugins.context_parallel",
}

__all__ = [
    "NDParallelStrategy",
    "ParallelDims",
    "ParallelConfig",
    "PRESETS",
    "Preset",
    "register_presets",
    "apply_context_parallel",
    "context_parallel_attention",
    "shard_batch",
]


def __getattr__(name: str) -> Any:
    """PEP 562: load a public name's module on first use."""
    if name in _WHERE:
        value = getattr(importlib.import_module(_WHERE[name]), name)
        globals()[name] = value  # later lookups skip this function
        return value
    raise AttributeError(f"module 'meshkit.plugins' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
