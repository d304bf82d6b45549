"""One name, one meaning (issue 28): a public name is defined in one meshkit module; the others import it.

Read from the source (``ast``), so a second ``SCHEDULES`` or ``theoretical_bubble`` anywhere in meshkit fails
here, with the modules that define it. A module's public names are those in its ``__all__``; a name one of them
exports may be defined nowhere else at module level, public, in meshkit (a private ``_name`` is the module's own).
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "meshkit"

VERB_PROTOCOL = {"configure_parser", "run_cli"}
"""Every verb module defines these by design (meshkit.cli calls them; tests/unit/test_entry_points.py)."""


def _definitions() -> tuple[dict[str, list[str]], dict[str, set[str]]]:
    """(public name -> modules defining it at top level, module -> its ``__all__``)."""
    defined: dict[str, list[str]] = defaultdict(list)
    exported: dict[str, set[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        module = str(path.relative_to(ROOT))
        names: set[str] = set()
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Assign):
                names.update(t.id for t in node.targets if isinstance(t, ast.Name))
                if any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
                    # literal entries (a package's lazy ``[*_WHERE]`` re-exports names defined elsewhere)
                    exported[module] = {c.value for c in ast.walk(node.value)
                                        if isinstance(c, ast.Constant) and isinstance(c.value, str)}
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names.add(node.target.id)
        for name in names:
            if not name.startswith("_"):
                defined[name].append(module)
    return defined, exported


def test_each_public_name_is_defined_once():
    defined, exported = _definitions()
    public = {name for module, names in exported.items() for name in names if module in defined.get(name, [])}
    twice = {name: defined[name] for name in public if len(defined[name]) > 1 and name not in VERB_PROTOCOL}
    assert not twice, twice


def test_the_renamed_items_are_one_object_each():
    import meshkit.profiling as profiling
    from meshkit import hardware, schedules
    from meshkit.plugins import pipeline
    from meshkit.profiling import bubble, flops, occupancy

    # one bubble theory: every place that offers it hands out the ground floor's function
    assert bubble.theoretical_bubble is schedules.theoretical_bubble is pipeline.theoretical_bubble
    assert profiling.theoretical_bubble is schedules.theoretical_bubble
    # one schedule vocabulary: pipeline's SCHEDULES covers every name, bubble's simulated ones are some of them
    assert tuple(pipeline.SCHEDULES) == schedules.SCHEDULE_NAMES
    assert set(bubble.SIMULATED_SCHEDULES) < set(schedules.SCHEDULE_NAMES)
    # one GPU record: the peak table and occupancy's SM table hold the catalog's own rows
    assert all(any(row is c for c in hardware.CATALOG) for row in flops.PEAK_TABLE)
    assert all(any(row is c for c in hardware.CATALOG) for row in occupancy.GPUS.values())
