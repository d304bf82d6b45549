"""The import rules of docs/architecture.md, checked on the source's import statements.

ground floor (hardware, loss, modelspec, quiet, schedules, timeline, verbs) imports nothing of meshkit; kernels/ only the
ground floor; models/ and integrations/ kernels/ and the ground floor; families/ the
ground floor; profiling/ never plugins/; planner/ the ground floor and profiling/ (never plugins/).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "meshkit"
GROUND = {"meshkit.hardware", "meshkit.lazy", "meshkit.loss", "meshkit.modelspec", "meshkit.quiet", "meshkit.schedules",
          "meshkit.timeline", "meshkit.verbs"}

# package prefix -> the meshkit packages/modules it may import (besides itself)
ALLOWED: dict[str, set[str]] = {
    **{g: set() for g in GROUND},
    "meshkit.kernels": GROUND,
    "meshkit.models": GROUND | {"meshkit.kernels"},
    "meshkit.integrations": GROUND | {"meshkit.kernels", "meshkit.models"},
    "meshkit.families": GROUND,
    "meshkit.profiling": GROUND | {"meshkit.kernels"},
    "meshkit.planner": GROUND | {"meshkit.profiling"},
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every meshkit module named by an import statement in ``path`` (relative imports resolved; anywhere in the
    file: module level, in functions, under ``if TYPE_CHECKING:``)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            found.add(mod)
            found.update(f"{mod}.{a.name}" for a in node.names)
    return {m for m in found if m == "meshkit" or m.startswith("meshkit.")}


def _owner(module: str) -> str | None:
    for prefix in sorted(ALLOWED, key=len, reverse=True):
        if module == prefix or module.startswith(prefix + "."):
            return prefix
    return None


# (importer, imported) pairs allowed against the rules: none (the Doctor switches MFUMonitor on from above).
EXCEPTIONS: set[tuple[str, str]] = set()


def _allowed(importer: str, imported: str) -> bool:
    if (importer, imported) in EXCEPTIONS:
        return True
    owner = _owner(importer)
    if owner is None or imported == owner or imported.startswith(owner + "."):
        return True
    return any(imported == a or imported.startswith(a + ".") for a in ALLOWED[owner])


FILES = sorted(p for p in ROOT.rglob("*.py"))


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT.parent)))
def test_imports_follow_the_layers(path: Path) -> None:
    importer = _module_name(path)
    bad = sorted(m for m in _imports(path) if not _allowed(importer, m) and _real(m))
    assert not bad, f"{importer} imports {bad}: see docs/architecture.md, 'What may import what'"


def _real(module: str) -> bool:
    """``from meshkit.x import name`` also yields ``meshkit.x.name``; count it only when it is a module."""
    parts = module.split(".")
    return (ROOT.parent.joinpath(*parts).with_suffix(".py").is_file()
            or ROOT.parent.joinpath(*parts, "__init__.py").is_file()) or module.count(".") <= 1


def test_the_check_sees_a_violation(tmp_path: Path) -> None:
    # The rule itself can fail: profiling importing plugins is refused.
    assert not _allowed("meshkit.profiling.mfu", "meshkit.plugins.strategy")
    assert not _allowed("meshkit.hardware", "meshkit.profiling.flops")
    assert not _allowed("meshkit.kernels.rope", "meshkit.models.llama")
    assert _allowed("meshkit.plugins.strategy", "meshkit.profiling.bubble")
    assert _allowed("meshkit.profiling.flops", "meshkit.hardware")
    assert not _allowed("meshkit.planner.search", "meshkit.plugins.dims")  # the planner builds no plugins types
    assert not _allowed("meshkit.profiling.flops", "meshkit.planner.costs")
    assert _allowed("meshkit.planner.costs", "meshkit.profiling.flops")
    assert _allowed("meshkit.plugins.dims", "meshkit.planner")


# ---- no import cycles -------------------------------------------------------------------------------------
MODULES = {_module_name(p): p for p in FILES}


def _type_checking(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (getattr(test, "id", None) == "TYPE_CHECKING"
                                         or getattr(test, "attr", None) == "TYPE_CHECKING")


def _edges(name: str, path: Path) -> set[str]:
    """The meshkit modules ``name`` imports when it runs: module-level and function-level imports alike (a loop
    through a function is still two modules that need each other), not those under ``if TYPE_CHECKING:`` (they
    never run). ``from P import x`` is an edge to ``P.x`` when that is a module, else to ``P``; a module's
    own enclosing packages count only through ``from P import name`` (a name P's ``__init__`` must already
    have): Python initialises them before the module anyway."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[tuple[str, bool]] = set()  # (module, needs its attributes)

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if _type_checking(child):
                for c in child.orelse:
                    visit(c)
                continue
            if isinstance(child, ast.Import):
                found.update((a.name, False) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = package.split(".")[: len(package.split(".")) - child.level + 1] if child.level else []
                mod = ".".join(base + ([child.module] if child.module else []))
                found.update((f"{mod}.{a.name}", False) if f"{mod}.{a.name}" in MODULES else (mod, True)
                             for a in child.names)
            visit(child)

    visit(ast.parse(path.read_text()))
    out = set()
    for mod, attrs in found:
        while mod and mod not in MODULES:
            mod = mod.rpartition(".")[0]
        if mod and mod != name and (attrs or not name.startswith(mod + ".")):
            out.add(mod)
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                out.append(sorted(part))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return out


def test_no_import_cycles() -> None:
    cycles = _cycles({name: _edges(name, path) for name, path in MODULES.items()})
    assert not cycles, f"import cycles among meshkit modules: {cycles}; a lower module must not import a higher one"


def test_the_cycle_check_sees_a_cycle(tmp_path: Path) -> None:
    # a -> b -> c -> a through a function-level import; a TYPE_CHECKING import and a package's own __init__ do
    # not count (the code before this change had two: MFUMonitor <-> doctor, planner search <-> explain)
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
    mod = tmp_path / "meshkit" / "doctor" / "callback.py"
    mod.parent.mkdir(parents=True)
    mod.write_text("from typing import TYPE_CHECKING\nimport meshkit.doctor\nfrom meshkit.doctor import checks\n"
                   "if TYPE_CHECKING:\n    from meshkit.plugins.dims import ParallelDims\n"
                   "def f():\n    from meshkit.profiling.mfu import batch_tokens\n")
    assert _edges("meshkit.doctor.callback", mod) == {"meshkit.doctor.checks", "meshkit.profiling.mfu"}
    mod.write_text("from meshkit.doctor import RULES\n")  # a name the package's __init__ must already hold
    assert _edges("meshkit.doctor.callback", mod) == {"meshkit.doctor"}
