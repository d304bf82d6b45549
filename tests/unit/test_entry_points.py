"""``meshkit VERB`` (or ``python -m meshkit VERB``) is the one command line.

A verb's module is a library module: it has ``configure_parser`` and ``run_cli`` and no
``if __name__ == "__main__":`` block of its own (issue 28: eight such blocks existed only to say "not a
command"). The only entry points are ``meshkit/__main__.py`` and ``meshkit/cli.py``; both are run for real.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

from meshkit.verbs import VERBS

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "meshkit"
ENTRY_POINTS = {"meshkit/__main__.py", "meshkit/cli.py"}


def _has_main_block(tree: ast.Module) -> bool:
    return any(
        isinstance(node, ast.If) and ast.unparse(node.test) in ("__name__ == '__main__'", '__name__ == "__main__"')
        for node in tree.body
    )


def test_only_the_command_line_has_a_main_block():
    found = {
        str(path.relative_to(ROOT))
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.name == "__main__.py" or _has_main_block(ast.parse(path.read_text()))
    }
    assert found == ENTRY_POINTS, sorted(found)


def test_every_verb_module_is_a_library_module():
    import importlib

    for verb, (module, _) in VERBS.items():
        mod = importlib.import_module(module)
        assert callable(getattr(mod, "configure_parser", None)) and callable(getattr(mod, "run_cli", None)), verb


def test_python_m_meshkit_runs_the_command_line():
    """Both entry points for real, with a verb that imports no torch (``meshkit bubble``'s theory)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for argv in (["-m", "meshkit", "bubble", "--help"], [str(PACKAGE / "cli.py"), "bubble", "--help"]):
        proc = subprocess.run([sys.executable, *argv], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
        assert proc.returncode == 0 and proc.stdout.startswith("usage: meshkit bubble"), (argv, proc.stdout, proc.stderr)
