"""A quiet console: README's ``meshkit demo`` (at 12 steps, the ``demo_run`` fixture) prints meshkit's own lines,
Lightning's start-up lines and progress bar, and no warning.

Issue 26 counted, on 4 ranks: 8 kineto ``USDT ... profiler_start/stop`` lines (meshkit.profiling.window filters
them), 4-8 ``LeafSpec`` deprecation warnings (NDParallelStrategy filters Lightning's own call site), ``FLOPs 0`` in
Lightning's model summary (the demo prints its parameters and model FLOPs instead).
"""

from __future__ import annotations

import re

import pytest

pytestmark = pytest.mark.slow

WARNING_LINE = re.compile(
    r"Warning\b|WARNING|warnings\.warn|\bdeprecated\b|^USDT:|^STAGE:|^\[W\d{4}|^W\d{4} |defaulting to", re.I | re.M)
"""What counts as a warning line: Python warnings of any category, logging's WARNING, torch's C++ ``[W...]`` and
glog ``W....`` lines, kineto's USDT/STAGE lines, and Lightning's "defaulting to" notes."""


def test_demo_console_has_no_warning_lines(demo_run):
    lines = demo_run.console.splitlines()
    warnings = [line for line in lines if WARNING_LINE.search(line)]
    assert warnings == [], "\n".join(warnings)
    assert "FLOPs: 0" not in demo_run.console and "Total FLOPs" not in demo_run.console
    # meshkit's own lines, once each (rank 0)
    assert sum("meshkit: hsdp_tp layout" in line for line in lines) == 1, demo_run.console[-3000:]
    assert sum(line.startswith("meshkit demo: Llama-style model") for line in lines) == 1, demo_run.console[-3000:]
    assert re.search(r"meshkit demo: .* trained 12 steps, final loss [\d.]+", demo_run.console), demo_run.console[-3000:]
