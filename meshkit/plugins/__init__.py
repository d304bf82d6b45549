"""meshkit.plugins: everything that changes how a model is trained."""

from meshkit.plugins.dims import ParallelDims
from meshkit.plugins.strategy import PRESETS, NDParallelStrategy, register_presets

__all__ = ["NDParallelStrategy", "ParallelDims", "PRESETS", "register_presets"]
