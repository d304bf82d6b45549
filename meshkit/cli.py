"""`meshkit` command line: ``meshkit demo | plan | analyze | occupancy | bubble | doctor | consolidate``.

Each verb lives in the module that owns it; that module defines ``configure_parser(parser)``
and ``run_cli(args) -> int``. Only the chosen verb's module is imported.

This file imports only the standard library (and ``import meshkit``, which loads neither torch nor
Lightning), so ``meshkit --help`` answers in a fraction of a second.

Example::

    >>> from meshkit.cli import main
    >>> main(["bubble", "-p", "4", "-m", "8"])  # doctest: +SKIP
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Sequence

from meshkit.verbs import VERBS

__all__ = ["main"]


def _top_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="meshkit", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="verb", metavar="VERB")
    for verb, (_, help_) in VERBS.items():
        sub.add_parser(verb, help=help_)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in VERBS:
        parser = _top_parser()
        if argv and not argv[0].startswith("-"):
            parser.error(f"unknown verb {argv[0]!r}; choose from {', '.join(VERBS)}")
        parser.print_help()
        return 0 if argv else 2
    verb, rest = argv[0], argv[1:]
    module_name, help_ = VERBS[verb]
    module = importlib.import_module(module_name)
    parser = argparse.ArgumentParser(prog=f"meshkit {verb}", description=help_)
    module.configure_parser(parser)
    args = parser.parse_args(rest)
    try:
        return int(module.run_cli(args) or 0)
    except (ValueError, OSError) as e:  # a user's input (bad argument, file, checkpoint): one line, exit 2
        print(f"meshkit {verb}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
