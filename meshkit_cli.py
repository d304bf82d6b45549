"""The ``meshkit`` console script: answers ``meshkit``, ``meshkit --help`` and unknown verbs without Lightning.

``import meshkit`` registers the strategy presets with Lightning, which takes seconds, and
``meshkit.cli`` is inside that package. This top-level module loads ``meshkit/cli.py`` (the verb table
and the parser; it imports only the standard library) from its file, without running the package's
``__init__``; only a chosen verb imports ``meshkit`` and the verb's own module.

Example::

    $ meshkit --help              # 0.2 s (median of 5 on 2 busy cores; 28 s when it imported Lightning)
    $ meshkit plan --help         # imports meshkit (Lightning) and meshkit.plugins.planner
"""

from __future__ import annotations

import importlib.util
import os
import sys
from types import ModuleType
from typing import Sequence

__all__ = ["main"]


def _verb_table() -> ModuleType:
    """``meshkit/cli.py`` loaded from its file (the package is located, not imported)."""
    spec = importlib.util.find_spec("meshkit")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("meshkit: the meshkit package is not installed (pip install -e .)")
    path = os.path.join(list(spec.submodule_search_locations)[0], "cli.py")
    cli_spec = importlib.util.spec_from_file_location("_meshkit_cli_table", path)
    module = importlib.util.module_from_spec(cli_spec)
    cli_spec.loader.exec_module(module)
    return module


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``meshkit VERB ...``; help and errors about the verb come from the verb table alone."""
    argv = list(sys.argv[1:] if argv is None else argv)
    table = _verb_table()
    if argv and argv[0] in table.VERBS:
        from meshkit.cli import main as run_verb  # imports meshkit: presets registered, Lightning loaded

        return run_verb(argv)
    return table.main(argv)


if __name__ == "__main__":
    raise SystemExit(main())
