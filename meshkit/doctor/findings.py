"""The finding record, the rules it is checked against, and ``<log_dir>/doctor.json``.

A finding is one failure that raises no error: a stable ``id`` (a key of :data:`RULES`), a
``severity`` (:data:`SEVERITIES`), the ``rank`` it was seen on (None: the whole run), the
``evidence`` in numbers, and the ``fix`` in one sentence. ``doctor.json`` is
``{"findings": [{"id", "severity", "rank", "evidence", "fix"}], "run": {...}}``; ``run`` holds
what the next run in the same log directory compares itself with (global batch, learning rate).

Example::

    >>> f = Finding("few_microbatches", "warning", None, {"pp": 4, "microbatches": 4}, "Use m >= 16.")
    >>> f.to_dict()["id"], format_findings([f]).splitlines()[1].startswith("WARNING")
    ('few_microbatches', True)
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Sequence

__all__ = [
    "SEVERITIES",
    "Rule",
    "RULES",
    "Finding",
    "REPORT_FILE",
    "write_report",
    "read_report",
    "merge_ranks",
    "format_findings",
    "findings_markdown",
]

SEVERITIES: tuple[str, ...] = ("info", "warning", "error")
"""Least to most severe. A healthy run has nothing above "info"."""

REPORT_FILE = "doctor.json"


@dataclass(frozen=True)
class Rule:
    """What a finding checks and where the rule comes from (docs/doctor.md lists every one)."""

    rule: str
    source: str


_S0 = "seed 000 §19 (the failures that cost clusters most and raise no error)"
_S2 = "seed 002"
RULES: dict[str, Rule] = {
    "tp_across_nodes": Rule("every tensor-parallel group lies inside one node (TP on NVLink, PP/DP across nodes)",
                            _S0 + ": 'nothing errors; 76 ms per step becomes 687 ms'"),
    "preset_fallback": Rule("an axis the preset turns on (tp, cp, replicate) is > 1 after 'auto' resolution",
                            "issue 18: devices=3 with hsdp_tp silently ran tp=1"),
    "one_fsdp_unit": Rule("no FSDP unit holds more than half the parameters (one unit per repeated block, then the roots; "
                          "a tied weight counted once); a vocabulary that outweighs wrapped blocks is 'info'",
                          "issue 18: a model without repeated blocks trained as one FSDP unit; issue 26"),
    "few_microbatches": Rule("micro-batches m >= 2p for p pipeline stages (schedules.MICROBATCHES_PER_STAGE)",
                             "meshkit.schedules.MICROBATCHES_PER_STAGE (the pipeline's default; " + _S2 + " said 4p)"),
    "dp_overlap": Rule("tokens per data-parallel rank per step T >= F/W (F achieved FLOP/s, W the dp link's bytes/s)",
                       _S2 + ": T ≥ F/W; meshkit.planner.dp_overlap_tokens"),
    "global_batch_changed": Rule("the global batch equals the previous run's in the same log directory, or the "
                                 "learning rate changed with it", _S2 + ": the learning rate nobody re-tuned"),
    "unused_parameters": Rule("every trainable parameter has a gradient after the first backward",
                              _S2 + ": the all-reduce that hangs"),
    "identical_batches": Rule("data-parallel ranks see different batches (hash of each rank's first batches)",
                              "issue 18"),
    "straggler": Rule("no rank arrives later than the others by more than the run's own noise floor",
                      _S0 + ": one straggler 'slows all 512 of them'"),
    "pp_unbalanced": Rule("pipeline stages take equal compute time per step, within the run's noise floor",
                          _S0 + ": 'the slowest stage sets the rate'"),
    "zero3_exposed_allgather": Rule("ZeRO-3 all-gathers are hidden behind compute (exposed < 10 % of the step)",
                                    _S0 + " / " + _S2 + ": ZeRO-3 on a slow fabric; ZeRO-2 is often faster and fits"),
    "unreadable_trace": Rule("every torch.profiler trace under the log directory can be read (the trace checks "
                             "above are not silently skipped)", "issue 14: bad events must be flagged, not zeroed"),
    "low_occupancy": Rule("Triton kernels reach >= 25 % warp occupancy and do not spill registers",
                          _S2 + ": low occupancy from register or shared-memory pressure"),
    "mfu_band": Rule("MFU above 40 % excellent, 30–40 % good, well below 30 % something is badly wrong",
                     "seed 004"),
}


@dataclass
class Finding:
    """One failure that raises no error. ``rank`` None: the whole run (or every rank alike)."""

    id: str
    severity: str
    rank: int | None
    evidence: dict[str, Any] = field(default_factory=dict)
    fix: str = ""

    def __post_init__(self) -> None:
        if self.id not in RULES:
            raise ValueError(f"Finding: `id={self.id!r}` is not a known finding; use one of {sorted(RULES)}.")
        if self.severity not in SEVERITIES:
            raise ValueError(f"Finding: `severity={self.severity!r}` must be one of {SEVERITIES}.")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Finding":
        return cls(d["id"], d["severity"], d.get("rank"), dict(d.get("evidence") or {}), d.get("fix", ""))


def _order(findings: Iterable[Finding]) -> list[Finding]:
    return sorted(findings, key=lambda f: (-SEVERITIES.index(f.severity), f.id, -1 if f.rank is None else f.rank))


def merge_ranks(per_rank: Sequence[Sequence[Finding]]) -> list[Finding]:
    """One list from every rank's: a finding identical (id, evidence, fix) on every rank becomes rank None."""
    groups: dict[str, list[Finding]] = {}
    for findings in per_rank:
        for f in findings:
            key = json.dumps([f.id, f.severity, f.evidence, f.fix], sort_keys=True, default=str)
            groups.setdefault(key, []).append(f)
    out = []
    for same in groups.values():
        if len(same) == len(per_rank) > 1 or all(f.rank is None for f in same):
            out.append(Finding(same[0].id, same[0].severity, None, same[0].evidence, same[0].fix))
        else:
            out.extend(same)
    return _order(out)


def write_report(log_dir: str | os.PathLike, findings: Sequence[Finding], run: dict[str, Any] | None = None) -> str:
    """Write ``<log_dir>/doctor.json``; returns its path."""
    os.makedirs(log_dir, exist_ok=True)
    path = os.path.join(log_dir, REPORT_FILE)
    payload = {"findings": [f.to_dict() for f in _order(findings)], "run": run or {}}
    with open(path + ".tmp", "w") as f:
        json.dump(payload, f, indent=1, default=str)
    os.replace(path + ".tmp", path)
    return path


def read_report(path: str | os.PathLike) -> tuple[list[Finding], dict[str, Any]]:
    """(findings, run) from a ``doctor.json`` file or a directory holding one."""
    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, REPORT_FILE)
    try:
        with open(path) as f:
            payload = json.load(f)
    except (OSError, ValueError) as exc:
        raise ValueError(f"read_report: cannot read `path={path!r}` ({exc}); pass a run's <log_dir>.") from None
    return [Finding.from_dict(d) for d in payload.get("findings", [])], dict(payload.get("run") or {})


def _evidence_text(evidence: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in evidence.items())


def format_findings(findings: Sequence[Finding]) -> str:
    """The rank-0 print and ``meshkit doctor``'s text output: one block per finding, worst first."""
    if not findings:
        return "meshkit doctor: no findings"
    worst = max(SEVERITIES.index(f.severity) for f in findings)
    lines = [f"meshkit doctor: {len(findings)} finding(s), worst: {SEVERITIES[worst]}"]
    for f in _order(findings):
        where = "all ranks" if f.rank is None else f"rank {f.rank}"
        lines.append(f"{f.severity.upper():<8} {f.id} ({where}): {_evidence_text(f.evidence)}")
        lines.append(f"         fix: {f.fix}")
    return "\n".join(lines)


def findings_markdown(findings: Sequence[Finding]) -> str:
    """Markdown for TensorBoard's text tab: a short summary table (severity, finding, rank), then one section
    per finding with its evidence as a list and its fix as a sentence. (A five-column table with the evidence
    and the fix in cells was squeezed unreadable in the TEXT tab, issue 26.)

    >>> print(findings_markdown([Finding("straggler", "warning", 3, {"late_ms": 50.0}, "Look at rank 3.")]))
    **meshkit doctor**: 1 finding(s), worst: warning
    <BLANKLINE>
    | severity | finding | rank |
    |---|---|---|
    | warning | `straggler` | 3 |
    <BLANKLINE>
    #### warning: `straggler` (rank 3)
    <BLANKLINE>
    - late_ms: 50.0
    <BLANKLINE>
    **Fix**: Look at rank 3.
    """
    if not findings:
        return "**meshkit doctor**: no findings."
    ordered = _order(findings)
    worst = max(SEVERITIES.index(f.severity) for f in findings)
    out = [f"**meshkit doctor**: {len(findings)} finding(s), worst: {SEVERITIES[worst]}", "",
           "| severity | finding | rank |", "|---|---|---|"]
    out += [f"| {f.severity} | `{f.id}` | {'all' if f.rank is None else f.rank} |" for f in ordered]
    for f in ordered:
        where = "all ranks" if f.rank is None else f"rank {f.rank}"
        out += ["", f"#### {f.severity}: `{f.id}` ({where})", ""]
        out += [f"- {k}: {v}" for k, v in f.evidence.items()]
        out += ["", f"**Fix**: {f.fix}"]
    return "\n".join(out)
