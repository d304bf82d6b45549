"""meshkit: N-dimensional parallel training for PyTorch Lightning, and a profiler that says where MFU went.

``import meshkit`` makes the strategy names (``"hsdp_tp"``, ``"fsdp2"``, ...) usable in a Trainer,
whether Lightning is imported before or after it (:mod:`meshkit.registration` says how)::

    import lightning as L
    import meshkit

    trainer = L.Trainer(strategy="hsdp_tp", accelerator="cpu", devices=4)

``import meshkit`` itself imports neither torch nor Lightning (a few milliseconds): every public name
below loads its module on first use (:mod:`meshkit.lazy`, PEP 562), so ``meshkit analyze`` (numpy +
msgspec) and ``meshkit --help`` do not pay seconds for torch and Lightning.
"""

from __future__ import annotations

from meshkit import registration as _registration
from meshkit.lazy import lazy_names as _lazy_names

__version__ = "0.1.0"

# public name -> the module that owns it (loaded on first attribute access)
_WHERE: dict[str, str] = {
    "NDParallelStrategy": "meshkit.plugins.strategy",
    "NDParallelFabricStrategy": "meshkit.plugins.fabric",
    "NDParallelOptions": "meshkit.plugins.options",
    "ParallelDims": "meshkit.plugins.dims",
    "ParallelConfig": "meshkit.plugins.parallelize",
    "parallelize": "meshkit.plugins.parallelize",
    "PRESETS": "meshkit.plugins.presets",
    "apply_context_parallel": "meshkit.plugins.context_parallel",
    "context_parallel_attention": "meshkit.plugins.context_parallel",
    "shard_batch": "meshkit.plugins.context_parallel",
    "SCHEDULES": "meshkit.plugins.pipeline",
    "build_pipeline": "meshkit.plugins.pipeline",
    "pipeline_step": "meshkit.plugins.pipeline",
    "pipeline_eval": "meshkit.plugins.pipeline",
    "read_timeline": "meshkit.timeline",
    "ModelSpec": "meshkit.planner",
    "plan": "meshkit.planner",
    "plan_for_world": "meshkit.planner",
    "theoretical_occupancy": "meshkit.profiling.occupancy",
    "kernel_occupancy": "meshkit.profiling.occupancy",
    "sweep_occupancy": "meshkit.profiling.occupancy",
    "TritonKernelReport": "meshkit.profiling.occupancy",
    "MFUMonitor": "meshkit.profiling.mfu",
    "FabricMFU": "meshkit.profiling.fabric",
    "Doctor": "meshkit.doctor",
}

__all__ = [
    "NDParallelStrategy",
    "NDParallelFabricStrategy",
    "NDParallelOptions",
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
    "FabricMFU",
    "Doctor",
    "kernels",
    "__version__",
]

__getattr__, __dir__ = _lazy_names(__name__, _WHERE)  # ``meshkit.kernels`` (Triton: seconds) loads on first use
_registration.install()
