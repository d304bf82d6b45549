"""``python -m meshkit VERB ...``: the same command line as the ``meshkit`` console script.

As fast for ``--help``: the package's ``__init__`` imports neither torch nor Lightning (its public
names load on first use), and :mod:`meshkit.cli` imports only the chosen verb's module.
"""

from meshkit.cli import main

raise SystemExit(main())
