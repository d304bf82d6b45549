"""meshkit.plugins: everything that changes how a model is trained."""

from meshkit.plugins.context_parallel import apply_context_parallel, context_parallel_attention, shard_batch
from meshkit.plugins.dims import ParallelDims
from meshkit.plugins.parallelize import ParallelConfig
from meshkit.plugins.presets import PRESETS, Preset
from meshkit.plugins.strategy import NDParallelStrategy, register_presets

# ``parallelize`` (the function) is not re-exported here: ``meshkit.plugins.parallelize`` stays the module.
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
