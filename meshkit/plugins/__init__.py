"""meshkit.plugins: everything that changes how a model is trained.

Its public names load their modules on first use (:mod:`meshkit.lazy`, as ``meshkit``'s own), so importing one
does not pay seconds for torch and Lightning, which ``meshkit.plugins.strategy`` imports. The planner
(``meshkit.planner``, pure Python) changes no training and sits below this package.
"""

from __future__ import annotations

from meshkit.lazy import lazy_names as _lazy_names

# public name -> the module that owns it. ``parallelize`` (the function) is not re-exported here:
# ``meshkit.plugins.parallelize`` stays the module.
_WHERE: dict[str, str] = {
    "NDParallelStrategy": "meshkit.plugins.strategy",
    "register_presets": "meshkit.plugins.strategy",
    "NDParallelFabricStrategy": "meshkit.plugins.fabric",
    "NDParallelOptions": "meshkit.plugins.options",
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
    "NDParallelFabricStrategy",
    "NDParallelOptions",
    "ParallelDims",
    "ParallelConfig",
    "PRESETS",
    "Preset",
    "register_presets",
    "apply_context_parallel",
    "context_parallel_attention",
    "shard_batch",
]


__getattr__, __dir__ = _lazy_names(__name__, _WHERE)
