"""Ground floor: the verbs of the ``meshkit`` command line, each with the module that owns it.

``meshkit VERB`` (or ``python -m meshkit VERB``) is the one command line; a verb's module is a library
module with no ``__main__`` block (``tests/unit/test_entry_points.py``).

    >>> VERBS["bubble"][0]
    'meshkit.profiling.bubble'
    >>> verb_of("meshkit.doctor.cli")
    'doctor'
"""

from __future__ import annotations

__all__ = ["VERBS", "verb_of"]

# verb -> (module, one-line help)
VERBS: dict[str, tuple[str, str]] = {
    "demo": ("meshkit.demo", "train a small Llama on CPU gloo processes with strategy='hsdp_tp'"),
    "consolidate": ("meshkit.plugins.checkpoint.consolidate", "turn a sharded (DCP) checkpoint into one state-dict file"),
    "plan": (
        "meshkit.planner.cli",
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
