"""``meshkit doctor``: catch the failures that never raise an error.

- :mod:`~meshkit.doctor.findings`: the :class:`Finding` record, :data:`RULES` (every id, its rule
  and source), ``doctor.json``.
- :mod:`~meshkit.doctor.checks`: the static and dynamic checks, pure functions.
- :mod:`~meshkit.doctor.callback`: :class:`Doctor`, the Lightning callback (``meshkit.Doctor``).
- :mod:`~meshkit.doctor.cli`: ``meshkit doctor LOGDIR [--json]``.

Doctor sits on the top floor beside ``meshkit/cli.py``: it reads plugins/ (the mesh and layout) and
profiling/ (the measurements).

Names load on first use (:mod:`meshkit.lazy`): ``meshkit doctor`` checks its LOGDIR before torch or Lightning
is imported, and a log directory holding ``doctor.json`` is read without them.

>>> from meshkit.doctor import few_microbatches
>>> few_microbatches("1f1b", pp=2, microbatches=2).id
'few_microbatches'
"""

from __future__ import annotations

from meshkit.lazy import lazy_names as _lazy_names

__all__ = [
    "Doctor",
    "previous_run",
    "fsdp_units",
    "FsdpUnit",
    "Finding",
    "RULES",
    "SEVERITIES",
    "read_report",
    "write_report",
    "format_findings",
    "diagnose_logdir",
    "tp_across_nodes",
    "preset_fallback",
    "one_fsdp_unit",
    "few_microbatches",
    "dp_overlap",
    "global_batch_changed",
    "mfu_band",
    "unused_parameters",
    "identical_batches",
    "straggler",
    "pp_unbalanced",
    "zero3_exposed_allgather",
    "low_occupancy",
    "configure_parser",
    "run_cli",
]

_WHERE = {
    **dict.fromkeys(("Doctor", "previous_run", "fsdp_units"), "meshkit.doctor.callback"),
    **dict.fromkeys(("FsdpUnit", "dp_overlap", "few_microbatches", "global_batch_changed", "identical_batches",
                     "low_occupancy", "mfu_band", "one_fsdp_unit", "pp_unbalanced", "preset_fallback", "straggler",
                     "tp_across_nodes", "unused_parameters", "zero3_exposed_allgather"), "meshkit.doctor.checks"),
    **dict.fromkeys(("configure_parser", "diagnose_logdir", "run_cli"), "meshkit.doctor.cli"),
    **dict.fromkeys(("RULES", "SEVERITIES", "Finding", "format_findings", "read_report", "write_report"),
                    "meshkit.doctor.findings"),
}
__getattr__, __dir__ = _lazy_names(__name__, _WHERE)
