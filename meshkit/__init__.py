"""meshkit: N-dimensional parallel training for PyTorch Lightning, and a profiler that says where MFU went.

``import meshkit`` registers the strategy presets with Lightning::

    import lightning as L
    import meshkit

    trainer = L.Trainer(strategy="hsdp_tp", accelerator="cpu", devices=4)
"""

from meshkit.plugins import (
    PRESETS,
    NDParallelStrategy,
    ParallelConfig,
    ParallelDims,
    apply_context_parallel,
    context_parallel_attention,
    register_presets,
    shard_batch,
)
from meshkit.plugins.parallelize import parallelize
from meshkit.plugins.pipeline import SCHEDULES, build_pipeline, pipeline_eval, pipeline_step, read_timeline
from meshkit.plugins.planner import ModelSpec, plan, plan_for_world
from meshkit.profiling.occupancy import kernel_occupancy, sweep_occupancy, theoretical_occupancy

__version__ = "0.1.0"

__all__ = [
    "NDParallelStrategy",
    "ParallelDims",
    "ParallelConfig",
    "parallelize",
    "PRESETS",
    "apply_context_parallel",
    "context_parallel_attention",
    "shard_batch",
    "SCHEDULES",
    "build_pipeline",
    "pipeline_step",
    "pipeline_eval",
    "read_timeline",
    "ModelSpec",
    "plan",
    "plan_for_world",
    "theoretical_occupancy",
    "kernel_occupancy",
    "sweep_occupancy",
    "TritonKernelReport",
    "MFUMonitor",
    "kernels",
    "__version__",
]


def __getattr__(name: str):  # callbacks and Triton kernels load lazily: `import meshkit` stays light
    if name == "kernels":  # importing triton costs seconds on every rank; only fused-kernel users pay it
        import importlib

        return importlib.import_module("meshkit.kernels")
    if name == "MFUMonitor":
        from meshkit.profiling.mfu import MFUMonitor

        return MFUMonitor
    if name == "TritonKernelReport":
        from meshkit.profiling.occupancy import TritonKernelReport

        return TritonKernelReport
    raise AttributeError(f"module 'meshkit' has no attribute {name!r}")

register_presets()
