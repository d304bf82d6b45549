"""``meshkit doctor LOGDIR [--json]``: the findings of a finished run, as the run printed them.

It reads ``<LOGDIR>/doctor.json`` (found in LOGDIR or below it, newest first). A log directory
without one (a run without the Doctor callback) is checked from its files alone: the pipeline
timeline (``pp_unbalanced``) and torch.profiler traces (``zero3_exposed_allgather``).

Example::

    $ meshkit doctor lightning_logs/version_3 --json
"""

from __future__ import annotations

import argparse
import json
import os

from meshkit.doctor.findings import REPORT_FILE, Finding, format_findings, merge_ranks, read_report

__all__ = ["diagnose_logdir", "configure_parser", "run_cli"]


def _find_report(logdir: str) -> str | None:
    found = [os.path.join(root, REPORT_FILE) for root, _, files in os.walk(logdir) if REPORT_FILE in files]
    return max(found, key=os.path.getmtime) if found else None


def diagnose_logdir(logdir: str) -> tuple[list[Finding], str]:
    """(findings, where they came from) for a finished run's log directory."""
    if not os.path.isdir(logdir):
        raise ValueError(f"`LOGDIR={logdir!r}` is not a directory; pass a run's log_dir.")
    report = _find_report(logdir)
    if report is not None:
        return read_report(report)[0], report
    from meshkit.doctor import checks
    from meshkit.doctor.callback import traces_findings
    from meshkit.timeline import find_timeline_dir, read_timeline

    found: list[Finding] = []
    tdir = find_timeline_dir(logdir)
    if tdir is not None:
        f = checks.pp_unbalanced(read_timeline(tdir))
        found += [f] if f else []
    found += traces_findings(logdir)
    return merge_ranks([found]), f"files under {logdir} (no {REPORT_FILE})"


def configure_parser(parser: argparse.ArgumentParser) -> None:
    """``meshkit doctor LOGDIR [--json]``."""
    parser.add_argument("logdir", help="a run's log directory (where the Doctor callback wrote doctor.json)")
    parser.add_argument("--json", action="store_true", help='print {"findings": [...]} as JSON')


def run_cli(args: argparse.Namespace) -> int:
    findings, source = diagnose_logdir(args.logdir)  # a ValueError: meshkit.cli prints it, exit 2
    if args.json:
        print(json.dumps({"findings": [f.to_dict() for f in findings], "source": source}, indent=1, default=str))
    else:
        print(format_findings(findings))
        print(f"(from {source})")
    return 0
