"""``meshkit VERB`` is the one command line; ``python -m`` of a verb's library module is not a second one.

Every module that holds a verb (a top-level ``run_cli``, or a :data:`meshkit.cli.VERBS` row) ends with an
``if __name__ == "__main__":`` block that prints one line naming its verb and exits 2, so a script that
still runs ``python -m meshkit.profiling.overlap LOGDIR`` fails loudly instead of exiting 0 having done
nothing. The blocks are executed on their own (no torch import for the heavy modules); two modules are
run for real with ``python -m``.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

from meshkit.verbs import VERBS
from meshkit.verbs import verb_of as _verb_of

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "meshkit"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] in ("__init__", "__main__") else parts)


def _main_block(tree: ast.Module) -> ast.If | None:
    for node in tree.body:
        if (isinstance(node, ast.If) and isinstance(node.test, ast.Compare)
                and ast.unparse(node.test) in ("__name__ == '__main__'", "__name__ == \"__main__\"")):
            return node
    return None


@functools.lru_cache(maxsize=None)
def _verb_modules() -> tuple[Path, ...]:
    """Every file that must point to a verb: those defining a top-level run_cli, and each VERBS package's
    ``__main__.py`` (``python -m meshkit.doctor`` runs it)."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "cli.py" and path.parent == PACKAGE:
            continue  # meshkit/cli.py is the command line itself
        tree = ast.parse(path.read_text())
        if any(isinstance(n, ast.FunctionDef) and n.name == "run_cli" for n in tree.body):
            found.append(path)
    for module, _ in VERBS.values():
        package = PACKAGE.parent.joinpath(*module.split("."))
        if package.is_dir():
            found.append(package / "__main__.py")
    return tuple(found)


def test_every_verb_module_is_covered():
    names = {_module_name(p) for p in _verb_modules()}
    assert {m for m, _ in VERBS.values()} <= names, "a VERBS module without run_cli or __main__.py"
    assert len(names) >= 8  # analyze, bubble, occupancy, plan, doctor (package and cli), demo, consolidate


@pytest.mark.parametrize("path", _verb_modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_python_m_of_a_verb_module_points_to_the_verb(path: Path):
    assert path.is_file(), f"{path.relative_to(ROOT)} is missing"
    block = _main_block(ast.parse(path.read_text()))
    assert block is not None, f"{path.relative_to(ROOT)} has no `if __name__ == '__main__':` block"
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()) as out:
        with pytest.raises(SystemExit) as exit_:
            exec(compile(ast.Module(body=block.body, type_ignores=[]), str(path), "exec"), {"__name__": "__main__"})
    verb = _verb_of(_module_name(path))
    assert exit_.value.code == 2 and out.getvalue() == ""
    (line,) = err.getvalue().splitlines()
    assert line.startswith(f"{_module_name(path)} is not a command") and f"`meshkit {verb}`" in line, line


def test_python_m_for_real():
    """The two modules the review found silent, run as ``python -m`` with an argument (both import no torch)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = {m: subprocess.Popen([sys.executable, "-m", m, "logs"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True, env=env, cwd=ROOT)
             for m in ("meshkit.profiling.overlap", "meshkit.profiling.bubble")}
    for module, proc in procs.items():
        out, err = proc.communicate(timeout=120)
        assert (proc.returncode, out) == (2, ""), (module, proc.returncode, out, err)
        assert err == f"{module} is not a command: run `meshkit {_verb_of(module)}` (or `python -m meshkit " \
                      f"{_verb_of(module)}`).\n"
