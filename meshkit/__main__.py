"""``python -m meshkit VERB ...``: the same command line as the ``meshkit`` console script.

Not as fast for ``--help``: Python imports the ``meshkit`` package (whose ``__init__`` registers the
strategy presets with Lightning, seconds) before it runs this file, so nothing here can skip that.
The console script (top-level ``meshkit_cli``) answers ``meshkit --help`` without importing the package.
"""

from meshkit.cli import main

raise SystemExit(main())
