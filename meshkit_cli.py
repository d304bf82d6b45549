"""The ``meshkit`` console script's entry point (``setup.cfg``: ``meshkit = meshkit_cli:main``).

``import meshkit`` imports neither torch nor Lightning, so the verb table in :mod:`meshkit.cli` is
imported plainly and ``meshkit --help`` stays fast; only a chosen verb imports its own module.
This module is kept so installed console scripts keep working; the command line lives in ``meshkit.cli``.

Example::

    $ meshkit --help              # no torch, no Lightning
    $ meshkit plan --help         # imports meshkit.plugins.planner (torch)
"""

from __future__ import annotations

from meshkit.cli import main

__all__ = ["main"]

if __name__ == "__main__":
    raise SystemExit(main())
