"""meshkit: N-dimensional parallel training for PyTorch Lightning, and a profiler that says where MFU went.

``import meshkit`` makes the strategy names (``"hsdp_tp"``, ``"fsdp2"``, ...) usable in a Trainer,
whether Lightning is imported before or after it::

    import lightning as L
    import meshkit

    trainer = L.Trainer(strategy="hsdp_tp", accelerator="cpu", devices=4)

``import meshkit`` itself imports neither torch nor Lightning (a few milliseconds): every public name
below loads its module on first use (PEP 562), so ``meshkit analyze`` (numpy + msgspec) and
``meshkit --help`` do not pay seconds for torch and Lightning.

How the names reach Lightning. Lightning resolves a strategy string when a ``Trainer`` is built:
``_AcceleratorConnector`` checks it against ``StrategyRegistry`` (a dict created when
``lightning.pytorch.strategies`` is imported) and calls ``StrategyRegistry.get(name)``. So the names
must be in that dict before the first ``Trainer(strategy=...)``, and not a moment earlier is needed:

- Lightning already imported (``"lightning"`` in ``sys.modules``): register at once.
- Otherwise: a one-shot ``sys.meta_path`` finder waits for the ``lightning`` package and registers
  right after its ``__init__`` has finished, then removes itself. The top-level package (not
  ``lightning.pytorch.strategies``) is the hook point because registering imports
  ``meshkit.plugins.strategy`` (torch, ``lightning.pytorch``): at the end of ``lightning/__init__``
  every Lightning module it needs is complete, while in the middle of Lightning's own import
  (where ``lightning.pytorch.strategies`` finishes) it would meet half-initialised modules.
  ``import lightning.pytorch`` always runs ``lightning/__init__`` first, so both spellings are covered.
  When ``meshkit.plugins.strategy`` is what imports Lightning (``meshkit.NDParallelStrategy`` used first),
  it is half-built at that moment, so the hook also watches ``meshkit.plugins.strategy`` and
  registers at the end of whichever of the two finishes last. Until then the finder costs two string
  comparisons per import.

The standalone ``pytorch_lightning`` package is not supported: ``NDParallelStrategy`` is a
``lightning.pytorch`` strategy, which ``pytorch_lightning.Trainer`` would refuse.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from types import ModuleType
from typing import Any

__version__ = "0.1.0"

# public name -> the module that owns it (loaded on first attribute access)
_WHERE: dict[str, str] = {
    "NDParallelStrategy": "meshkit.plugins.strategy",
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
    "ModelSpec": "meshkit.plugins.planner",
    "plan": "meshkit.plugins.planner",
    "plan_for_world": "meshkit.plugins.planner",
    "theoretical_occupancy": "meshkit.profiling.occupancy",
    "kernel_occupancy": "meshkit.profiling.occupancy",
    "sweep_occupancy": "meshkit.profiling.occupancy",
    "TritonKernelReport": "meshkit.profiling.occupancy",
    "MFUMonitor": "meshkit.profiling.mfu",
    "Doctor": "meshkit.doctor",
}

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
    "Doctor",
    "kernels",
    "__version__",
]


def __getattr__(name: str) -> Any:
    """PEP 562: load a public name's module on first use (``meshkit.kernels`` imports Triton: seconds)."""
    if name in _WHERE:
        value = getattr(importlib.import_module(_WHERE[name]), name)
        globals()[name] = value  # later lookups skip this function
        return value
    if not name.startswith("__") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f"{__name__}.{name}")  # a subpackage: meshkit.kernels, meshkit.profiling
    raise AttributeError(f"module 'meshkit' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


_WATCHED = ("lightning", "meshkit.plugins.strategy")  # the hook registers once both have finished importing
_loading: set[str] = set()  # watched packages whose __init__ is running now


def _register_presets() -> None:
    from meshkit.plugins.strategy import register_presets

    register_presets()


def _register_if_ready() -> None:
    """Register when Lightning is loaded and meshkit.plugins.strategy is not half-way through its own import
    (it imports Lightning itself: then its end, not Lightning's, is the moment)."""
    if "lightning" in sys.modules and not _loading:
        for finder in [f for f in sys.meta_path if type(f).__name__ == _RegisterAfterLightning.__name__]:
            sys.meta_path.remove(finder)  # one shot
        _register_presets()


class _ThenRegister(importlib.abc.Loader):
    """Runs a watched package's own loader, then registers meshkit's strategy names if ready."""

    def __init__(self, loader: importlib.abc.Loader) -> None:
        self.loader = loader

    def create_module(self, spec: Any) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        module.__loader__ = module.__spec__.loader = self.loader  # the package looks as if loaded plainly
        _loading.add(module.__name__)
        try:
            self.loader.exec_module(module)
        finally:
            _loading.discard(module.__name__)
        _register_if_ready()


class _RegisterAfterLightning(importlib.abc.MetaPathFinder):
    """Import hook: registers the presets right after ``import lightning`` completes, then removes itself."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname not in _WATCHED:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None  # not installed: Python raises its own ModuleNotFoundError
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _ThenRegister(spec.loader)
        return spec


if "lightning" in sys.modules:
    _register_presets()
elif not any(type(f).__name__ == _RegisterAfterLightning.__name__ for f in sys.meta_path):  # reload-safe
    sys.meta_path.insert(0, _RegisterAfterLightning())
