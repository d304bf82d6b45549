"""How ``import meshkit`` makes the strategy names (``"hsdp_tp"``, ``"fsdp2"``, ...) reach Lightning.

Lightning resolves a strategy string when a ``Trainer`` is built: ``_AcceleratorConnector`` checks it
against ``StrategyRegistry`` (a dict created when ``lightning.pytorch.strategies`` is imported) and
calls ``StrategyRegistry.get(name)``. So the names must be in that dict before the first
``Trainer(strategy=...)``, and not a moment earlier is needed. :func:`install` (run by ``meshkit/__init__``):

- Lightning already imported (``"lightning"`` in ``sys.modules``): register at once.
- Otherwise: a one-shot ``sys.meta_path`` finder waits for the ``lightning`` package and registers
  right after its ``__init__`` has finished, then removes itself. The top-level package (not
  ``lightning.pytorch.strategies``) is the hook point because registering imports
  ``meshkit.plugins.strategy`` (torch, ``lightning.pytorch``): at the end of ``lightning/__init__``
  every Lightning module it needs is complete, while in the middle of Lightning's own import
  (where ``lightning.pytorch.strategies`` finishes) it would meet half-initialised modules.
  ``import lightning.pytorch`` always runs ``lightning/__init__`` first, so both spellings are covered.
  When a meshkit module is what imports Lightning (``meshkit.NDParallelStrategy`` or ``meshkit.PRESETS``
  used first), it is half-built at that moment, and registering would import it again through
  ``meshkit.plugins.strategy`` (``meshkit.PRESETS`` first used to raise ``ImportError: cannot import
  name 'PRESETS' from partially initialized module``). So the hook watches every ``meshkit.*`` module
  too and registers at the end of the last of them to finish, once Lightning is loaded. Until then the
  finder costs a string comparison per import, and a second spec lookup per meshkit module.

The standalone ``pytorch_lightning`` package is not supported: ``NDParallelStrategy`` is a
``lightning.pytorch`` strategy, which ``pytorch_lightning.Trainer`` would refuse. This module imports
only the standard library (``import meshkit`` stays light); it sits on the top floor beside ``cli.py``.
"""

from __future__ import annotations

import importlib.abc
import sys
from types import ModuleType
from typing import Any

__all__ = ["install"]

_loading: set[str] = set()  # watched modules (lightning, meshkit.*) whose code is running now


def _watched(fullname: str) -> bool:
    """The hook registers once Lightning is loaded and none of these is half-way through its import."""
    return fullname == "lightning" or fullname.startswith("meshkit.")


def install() -> None:
    """Register meshkit's strategy names now if Lightning is loaded, else once its import completes (idempotent)."""
    if "lightning" in sys.modules:
        _register_presets()
    elif not any(type(f).__name__ == _RegisterAfterLightning.__name__ for f in sys.meta_path):  # reload-safe
        sys.meta_path.insert(0, _RegisterAfterLightning())


def _register_presets() -> None:
    from meshkit.plugins.fabric import register_fabric_presets
    from meshkit.plugins.strategy import register_presets

    register_presets()  # L.Trainer(strategy="hsdp_tp")
    register_fabric_presets()  # L.Fabric(strategy="hsdp_tp")


def _register_if_ready() -> None:
    """Register when Lightning is loaded and no meshkit module is half-way through its own import (one that
    imports Lightning itself: then its end, not Lightning's, is the moment)."""
    if "lightning" in sys.modules and not _loading:
        for finder in [f for f in sys.meta_path if type(f).__name__ == _RegisterAfterLightning.__name__]:
            sys.meta_path.remove(finder)  # one shot
        _register_presets()


class _ThenRegister(importlib.abc.Loader):
    """Runs a watched module's own loader, then registers meshkit's strategy names if ready."""

    def __init__(self, loader: importlib.abc.Loader) -> None:
        self.loader = loader

    def __getattr__(self, name: str) -> Any:  # get_code, get_source, is_package, ... (runpy, inspect)
        return getattr(self.loader, name)

    def create_module(self, spec: Any) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        module.__loader__ = module.__spec__.loader = self.loader  # the module looks as if loaded plainly
        _loading.add(module.__name__)
        try:
            self.loader.exec_module(module)
        finally:
            _loading.discard(module.__name__)
        _register_if_ready()


class _RegisterAfterLightning(importlib.abc.MetaPathFinder):
    """Import hook: registers the presets right after ``import lightning`` completes, then removes itself."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if not _watched(fullname):
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
