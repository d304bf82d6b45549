"""Ground floor: the verbs of the ``meshkit`` command line, each with the module that owns it, and the one
line such a module prints when run by itself (``python -m meshkit.profiling.bubble``): it is a library module,
not a command, so it names its verb and exits 2.

    >>> VERBS["bubble"][0]
    'meshkit.profiling.bubble'
    >>> verb_of("meshkit.doctor.cli")
    'doctor'
"""

from __future__ import annotations

import sys
from typing import NoReturn

__all__ = ["VERBS", "verb_of", "not_a_command"]

# verb -> (module, one-line help)
VERBS: dict[str, tuple[str, str]] = {
    "demo": ("meshkit.demo", "train a small Llama on CPU gloo processes with strategy='hsdp_tp'"),
    "consolidate": ("meshkit.plugins.checkpointing", "turn a sharded (DCP) checkpoint into one state-dict file"),
    "plan": (
        "meshkit.plugins.planner.cli",
        "rank every dp/pp/cp/tp layout of a model on a cluster: memory, comm, bubble, predicted MFU",
    ),
    "analyze": (
        "meshkit.profiling.overlap",
        "comm/compute overlap, exposed comm, idle and stragglers per rank from torch.profiler traces",
    ),
    "bubble": (
        "meshkit.profiling.bubble",
        "pipeline bubble: theory, schedule simulator, measured bubble from a run's pp_timeline",
    ),
    "occupancy": (
        "meshkit.profiling.occupancy.cli",
        "registers, spills, shared memory and warp occupancy of Triton kernels on any NVIDIA target, from this CPU",
    ),
    "doctor": ("meshkit.doctor", "the failures that raise no error (tp across nodes, stragglers, ...) from a run's logs"),
}


def verb_of(module: str) -> str:
    """The verb whose module is ``module`` or a package holding it (``meshkit.doctor.cli``: ``doctor``)."""
    (verb,) = [v for v, (m, _) in VERBS.items() if module == m or module.startswith(m + ".")]
    return verb


def not_a_command(module: str) -> NoReturn:
    """What a verb's module does under ``python -m``: one line on stderr naming the verb, exit status 2."""
    verb = verb_of(module)
    print(f"{module} is not a command: run `meshkit {verb}` (or `python -m meshkit {verb}`).", file=sys.stderr)
    raise SystemExit(2)
