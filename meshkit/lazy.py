"""The one lazy loader of public names (PEP 562), used by ``meshkit``, ``meshkit.plugins``, ``meshkit.profiling``
and ``meshkit.doctor``.

A package lists ``{public name: the module that owns it}``; :func:`lazy_names` gives it ``__getattr__``
and ``__dir__``: a name's module is imported on first use (then cached in the package's namespace), and
any submodule is reachable as an attribute, so importing the package costs nothing (``import meshkit``
loads neither torch nor Lightning). Ground floor: imports nothing of meshkit.

Example::

    >>> import types
    >>> pkg = types.ModuleType("demo")
    >>> pkg.__all__ = ["dumps"]
    >>> pkg.__getattr__, pkg.__dir__ = lazy_names(pkg, {"dumps": "json"})
    >>> pkg.dumps([1])
    '[1]'
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType
from typing import Any, Callable, Mapping

__all__ = ["lazy_names"]


def lazy_names(package: ModuleType | str, where: Mapping[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package`` (the module object, or its name in ``sys.modules``).

    ``where`` maps each public name to the module that defines it. Another name that is a submodule of the
    package (``meshkit.kernels``) is imported; anything else raises ``AttributeError`` as Python does.
    """
    import sys

    def module() -> ModuleType:
        return package if isinstance(package, ModuleType) else sys.modules[package]

    def __getattr__(name: str) -> Any:
        pkg = module()
        if name in where:
            value = getattr(importlib.import_module(where[name]), name)
            setattr(pkg, name, value)  # later lookups skip this function
            return value
        if (not name.startswith("__") and hasattr(pkg, "__path__")
                and importlib.util.find_spec(f"{pkg.__name__}.{name}") is not None):
            return importlib.import_module(f"{pkg.__name__}.{name}")
        raise AttributeError(f"module {pkg.__name__!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        pkg = module()
        return sorted(set(vars(pkg)) | set(getattr(pkg, "__all__", ())))

    return __getattr__, __dir__
