"""The import rules of docs/architecture.md, checked on the source's import statements.

ground floor (hardware, loss, modelspec, schedules, timeline, verbs) imports nothing of meshkit; kernels/ only the
ground floor; models/ and integrations/ kernels/ and the ground floor; profiling/ never plugins/.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "meshkit"
GROUND = {"meshkit.hardware", "meshkit.loss", "meshkit.modelspec", "meshkit.schedules", "meshkit.timeline",
          "meshkit.verbs"}

# package prefix -> the meshkit packages/modules it may import (besides itself)
ALLOWED: dict[str, set[str]] = {
    **{g: set() for g in GROUND},
    "meshkit.kernels": GROUND,
    "meshkit.models": GROUND | {"meshkit.kernels"},
    "meshkit.integrations": GROUND | {"meshkit.kernels", "meshkit.models"},
    "meshkit.profiling": GROUND | {"meshkit.kernels"},
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every meshkit module named by an import statement in ``path`` (relative imports resolved)."""
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


# The one exception, by name: MFUMonitor(doctor=True) switches the Doctor on (a lazy import in its setup).
EXCEPTIONS = {("meshkit.profiling.mfu", "meshkit.doctor")}


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
