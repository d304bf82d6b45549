"""meshkit: N-dimensional parallel training for PyTorch Lightning, and a profiler that says where MFU went.

``import meshkit`` registers the strategy presets with Lightning::

    import lightning as L
    import meshkit

    trainer = L.Trainer(strategy="hsdp_tp", accelerator="cpu", devices=4)
"""

from meshkit.plugins import PRESETS, NDParallelStrategy, ParallelDims, register_presets

__version__ = "0.1.0"

__all__ = ["NDParallelStrategy", "ParallelDims", "PRESETS", "__version__"]

register_presets()
