"""TensorBoard output: the tag names and units, the per-step scalars, tables and the waterfall.

Analysis elsewhere returns plain data; this module only draws and writes it, and it is the one home
of every tag meshkit writes for MFU and of its unit. Every writer function takes a
``SummaryWriter``-like object (``add_scalar``, ``add_text``, ``add_image``, ``add_custom_scalars``),
e.g. ``TensorBoardLogger.experiment``.

Where the view is (the built-in dashboards, no meshkit plugin): TensorBoard opens on its first
dashboard with data, TIME SERIES, which groups cards by the tag's text before the first ``/``,
sorts the groups and a group's cards (``/`` and digits first, then by character code, so upper case
before lower case) and expands only the first two groups. The headline tags therefore live in two
upper-case groups that sort before Lightning's ``epoch``, ``hp_metric`` and any lower-case tag:
:data:`HEADLINE_GROUP` (``MFU``: the waterfall, then MFU in percent: the first screen's top row) and
:data:`BREAKDOWN_GROUP` (``MFU_breakdown_pct``: one card per bucket, percent of the step time, right
below). Details (HFU, points lost, throughput, the per-window scalars, the Gantt) sit under
:data:`SCALAR_PREFIX` (``mfu``), a collapsed group. Every MFU and
breakdown value is in percent: MFU and HFU in percent of peak, a bucket in percent of the step's
wall time, points lost in MFU percentage points.

Example::

    >>> b = {"compute": 0.6, "recompute": 0.1, "exposed_comm": 0.1, "bubble": 0.0,
    ...      "data_wait": 0.05, "optimizer": 0.05, "other": 0.1}
    >>> print(markdown_table(b, mfu=0.3).splitlines()[0])
    | part | % of step | MFU points lost |
    >>> breakdown_tag("data_wait"), MFU_TAG
    ('MFU_breakdown_pct/data_wait', 'MFU/mfu_pct')
"""

from __future__ import annotations

import re
from typing import Any, Mapping, Sequence

import numpy as np

__all__ = [
    "BREAKDOWN_PARTS",
    "WATERFALL_PARTS",
    "HOST_OTHER_PARTS",
    "STEP_PHASES",
    "BETWEEN_STEPS_PARTS",
    "WHAT_TO_DO",
    "waterfall",
    "HEADLINE_GROUP",
    "BREAKDOWN_GROUP",
    "SCALAR_PREFIX",
    "MFU_TAG",
    "HFU_TAG",
    "WATERFALL_TAG",
    "TABLE_TAG",
    "GANTT_TAG",
    "LAYOUT_TITLE",
    "WATERFALL_POINTS_GROUP",
    "EXPOSED_COMM_GROUP",
    "waterfall_tag",
    "exposed_comm_tag",
    "largest_losses",
    "console_block",
    "breakdown_tag",
    "points_lost_tag",
    "window_tag",
    "fit_tag",
    "step_scalars",
    "where_to_look",
    "breakdown_layout",
    "points_lost",
    "markdown_table",
    "text_table",
    "overlap_markdown",
    "straggler_lines",
    "waterfall_image",
    "figure_to_array",
    "write_layout",
    "write_window",
]

BREAKDOWN_PARTS = ("compute", "recompute", "exposed_comm", "bubble", "data_wait", "optimizer", "validation",
                   "checkpoint", "profiler_overhead", "other")
"""The step's wall time, split: fractions ≥ 0 that sum to 1. Only ``compute`` produces model FLOPs.
``other`` is host time inside forward+backward between ops (and any timer gap); ``profiler_overhead``
is MFUMonitor's own time (starting, stopping, exporting, analysing and writing its windows)."""

WATERFALL_PARTS = ("exposed_comm", "bubble", "data_wait", "optimizer", "validation", "checkpoint",
                   "profiler_overhead", "host_other", "recompute", "non_matmul", "attention_efficiency",
                   "matmul_efficiency")
"""The losses of the MFU waterfall, in MFU points, in this order between ``peak`` (100) and ``achieved``
(the MFU in percent): a time bucket costs its share of the step × 100 (``host_other`` is the step model's
``other``); compute costs ``recompute`` (its share), ``non_matmul`` (ops/kernels that are neither matmul nor
attention), and per class ``<class>_efficiency`` = its time share × 100 − the model FLOPs it delivered as a
share of peak × step (:func:`waterfall`)."""

HOST_OTHER_PARTS = ("sync", "dtensor", "fsdp_hooks", "autograd_engine", "op_dispatch", "launch_gaps",
                    "python_between_ops", "unexplained")
"""``host_other`` split, first claim wins (the innermost first): the host waiting in a runtime sync call, in
DTensor's own Python (``from_local`` / ``to_local`` / ``redistribute`` and its dispatch: tensor parallelism's
cost on the host, even where it runs inside an FSDP hook or the autograd engine), in FSDP2's hooks
(``FSDP::*``), in the autograd engine outside its ops, in other containers that only dispatch (autograd
nodes); then inside forward+backward (meshkit's marker, else the host step): on CUDA ``launch_gaps`` (the
device idle while the host runs Python and launches), on CPU ``python_between_ops``; ``unexplained`` the rest."""

STEP_PHASES = ("data_wait", "stop_signal", "validation", "checkpoint", "profiler_overhead", "forward_backward",
               "optimizer")
"""MFUMonitor's timers: one step (previous batch end → this batch end) in disjoint phases that sum to its
wall time. Between the batches: ``stop_signal`` (Lightning's per-batch stop-signal broadcast, where ranks wait
for a slow rank: the breakdown's ``exposed_comm``), ``validation``, ``checkpoint`` (saves, and deletes of old
checkpoints), ``profiler_overhead``, and ``data_wait`` (the rest: fetching the batch, the loop's own work).
A save or validation run *inside* the batch (e.g. from ``training_step``) is taken out of the phase it ran in
(``forward_backward`` or ``optimizer``) and counted once, in its own phase."""

BETWEEN_STEPS_PARTS = ("setup", "sanity_check", "flop_count_step", "validation", "checkpoint", "profiler_overhead",
                       "other", "teardown")
"""``fit``'s wall time outside the measured steps (MFUMonitor's ``fit_time_s["between_steps"]``): ``setup``
(the monitor's setup hook → train start: model wrapping, optimizers, peak calibration, without the sanity
check), ``sanity_check`` (Lightning's sanity validation), ``flop_count_step`` (the batch FLOPs are counted
on: a step, but not a measurement), then after the last batch: ``validation``, ``checkpoint``,
``profiler_overhead`` and ``other`` (the loop's end) up to train end, and ``teardown`` (train end → the
teardown hook). With :data:`STEP_PHASES` summed over the steps they tile the monitor's view of ``fit``."""

WHAT_TO_DO = {
    "exposed_comm": "overlap or shrink communication: see exposed_comm_by_axis_ms (tp: smaller tp or async TP; "
                    "dp_shard: prefetch / reshard_after_forward=False / HSDP; pp: more micro-batches)",
    "bubble": "more micro-batches per step, or an interleaved/zero-bubble schedule (meshkit bubble)",
    "data_wait": "more DataLoader workers, pin_memory, prefetch_factor; keep the step loop free of host work",
    "optimizer": "a fused or foreach optimizer (fused=True), fewer optimizer steps (gradient accumulation)",
    "validation": "validate less often (val_check_interval) or on fewer batches (limit_val_batches)",
    "checkpoint": "checkpoint less often, or asynchronously",
    "profiler_overhead": "profile less often (profile_every) or fewer steps (profile_steps)",
    "host_other": "the host is too slow to feed the device: torch.compile or CUDA graphs, larger micro-batches; "
                  "see host_other_split",
    "recompute": "checkpoint fewer layers (selective activation checkpointing) if memory allows",
    "non_matmul": "fused norm/elementwise/loss kernels (meshkit's fused kernels, torch.compile)",
    "attention_efficiency": "a faster attention kernel (flash / cuDNN SDPA), longer sequences per kernel",
    "matmul_efficiency": "larger tile-aligned matmuls (hidden and ffn multiples of 128, a larger micro-batch), "
                         "bf16 instead of fp32",
}
"""One line per waterfall part: what to try when it is a large loss (TensorBoard's waterfall and table,
the console block, docs/profiling.md)."""


def waterfall(shares: Mapping[str, float], compute_classes: Mapping[str, float],
              delivered: Mapping[str, float]) -> list[dict[str, float]]:
    """The MFU waterfall from the peak: ``[{"part": "peak", "points": 100.0}, <each of WATERFALL_PARTS>,
    {"part": "achieved", "points": MFU in %}]``, the losses summing to ``100 - achieved``.

    ``shares``: the step time split by :data:`BREAKDOWN_PARTS` (fractions summing to 1; ``other`` is
    host_other). ``compute_classes``: the shares of ``compute`` time spent in ``attention`` and ``matmul``
    (non_matmul is the rest). ``delivered``: the model FLOPs of each class (``matmul``: 6N, ``attention``:
    12·L·H·Q·T) as a share of peak × step time; their sum is the MFU.

    >>> w = waterfall({"compute": 0.5, "other": 0.5}, {"matmul": 0.8, "attention": 0.0},
    ...               {"matmul": 0.3, "attention": 0.0})
    >>> [(p["part"], round(p["points"], 6)) for p in w if p["points"]]
    [('peak', 100.0), ('host_other', 50.0), ('non_matmul', 10.0), ('matmul_efficiency', 10.0), ('achieved', 30.0)]
    """
    c = shares.get("compute", 0.0)
    att, mm = compute_classes.get("attention", 0.0), compute_classes.get("matmul", 0.0)
    d_att, d_mm = delivered.get("attention", 0.0), delivered.get("matmul", 0.0)
    loss = {p: 100.0 * shares.get(p, 0.0) for p in WATERFALL_PARTS[:7]}
    loss.update(host_other=100.0 * shares.get("other", 0.0), recompute=100.0 * shares.get("recompute", 0.0),
                non_matmul=100.0 * c * max(1.0 - att - mm, 0.0), attention_efficiency=100.0 * (c * att - d_att),
                matmul_efficiency=100.0 * (c * mm - d_mm))
    return ([{"part": "peak", "points": 100.0}] + [{"part": p, "points": loss[p]} for p in WATERFALL_PARTS]
            + [{"part": "achieved", "points": 100.0 * (d_att + d_mm)}])


HEADLINE_GROUP = "MFU"
"""TIME SERIES group 1 (expanded, the first cards of the first screen): the waterfall image, MFU in percent."""
BREAKDOWN_GROUP = "MFU_breakdown_pct"
"""TIME SERIES group 2 (expanded on the first screen): one card per bucket, percent of the step time."""
SCALAR_PREFIX = "MFU_details"
"""The details group (collapsed): points lost, throughput, step time, per-window scalars, the Gantt. Not ``mfu``:
TensorBoard showed an ``MFU`` and an ``mfu`` group side by side (issue 26); every group name differs from the
others in more than case."""

WATERFALL_TAG = f"{HEADLINE_GROUP}/breakdown_waterfall"
"""Sorts first in its group (TIME SERIES sorts a group's cards by tag): the top-left card of the first screen."""
MFU_TAG = f"{HEADLINE_GROUP}/mfu_pct"
HFU_TAG = f"{SCALAR_PREFIX}/hfu_pct"
TABLE_TAG = f"{HEADLINE_GROUP}/breakdown_table"
"""The window's text (TEXT dashboard; torch's ``add_text`` appends ``/text_summary``)."""
GANTT_TAG = f"{SCALAR_PREFIX}/pipeline_gantt"
LAYOUT_TITLE = "MFU breakdown (percent)"
"""The custom-scalar category (CUSTOM SCALARS dashboard): one chart per series, each its own line."""


WATERFALL_POINTS_GROUP = f"{HEADLINE_GROUP}_waterfall_points"
"""One card per waterfall part (MFU points, rank 0, at each profiled window's step)."""
EXPOSED_COMM_GROUP = f"{HEADLINE_GROUP}_exposed_comm_ms"
"""One card per mesh axis: rank 0's exposed communication per step (ms) in each profiled window."""


def waterfall_tag(part: str) -> str:
    """A waterfall part's scalar, in MFU points: ``MFU_waterfall_points/<part>`` (``peak``, the losses of
    :data:`WATERFALL_PARTS`, ``achieved``)."""
    return f"{WATERFALL_POINTS_GROUP}/{part}"


def exposed_comm_tag(axis: str) -> str:
    """A mesh axis's exposed communication, ms per step: ``MFU_exposed_comm_ms/<axis>``."""
    return f"{EXPOSED_COMM_GROUP}/{axis}"


def breakdown_tag(part: str) -> str:
    """The per-step scalar of one bucket, in percent of the step time: ``MFU_breakdown_pct/<part>``."""
    return f"{BREAKDOWN_GROUP}/{part}"


def points_lost_tag(part: str) -> str:
    """The per-step scalar of the MFU percentage points one bucket costs: ``MFU_details/points_lost_pct/<part>``."""
    return f"{SCALAR_PREFIX}/points_lost_pct/{part}"


def fit_tag(section: str, part: str) -> str:
    """Where ``fit``'s time went, written once at train end (s): ``MFU_details/fit_s/<section>/<part>``,
    ``section`` ``steps`` (:data:`STEP_PHASES`) or ``between_steps`` (:data:`BETWEEN_STEPS_PARTS`), and
    ``MFU_details/fit_s/wall`` / ``.../accounted``.

    >>> fit_tag("steps", "checkpoint")
    'MFU_details/fit_s/steps/checkpoint'
    """
    return f"{SCALAR_PREFIX}/fit_s/{section}/{part}" if part else f"{SCALAR_PREFIX}/fit_s/{section}"


def window_tag(name: str) -> str:
    """A profiled window's scalar (same step as its table and waterfall): ``MFU_details/window/<name>``, where
    ``name`` is ``mfu_pct``, ``step_time_ms`` or ``breakdown_pct/<part>``."""
    return f"{SCALAR_PREFIX}/window/{name}"


def step_scalars(mfu: float, hfu: float, fractions: Mapping[str, float], *, step_time_s: float,
                 tflops_per_device: float, hardware_tflops_per_device: float, tokens_per_s: float,
                 tokens_per_s_per_device: float) -> dict[str, float]:
    """One step's scalars by tag, in their units (MFU, HFU and buckets in percent; see the module doc).

    >>> s = step_scalars(0.25, 0.3, {"compute": 0.5, "other": 0.5}, step_time_s=0.1, tflops_per_device=1,
    ...                  hardware_tflops_per_device=1.2, tokens_per_s=10, tokens_per_s_per_device=10)
    >>> s["MFU/mfu_pct"], s["MFU_breakdown_pct/other"], s["MFU_details/points_lost_pct/other"]
    (25.0, 50.0, 25.0)
    """
    t = _STEP_TAGS
    out = {MFU_TAG: 100.0 * mfu, HFU_TAG: 100.0 * hfu, t[0]: tflops_per_device, t[1]: hardware_tflops_per_device,
           t[2]: tokens_per_s, t[3]: tokens_per_s_per_device, t[4]: 1e3 * step_time_s}
    for k, tag in _BREAKDOWN_TAGS:
        out[tag] = 100.0 * fractions.get(k, 0.0)
    lost = points_lost(fractions, mfu)
    for k, tag in _LOST_TAGS:
        out[tag] = lost[k]
    return out


# every step logs these: their names are made once
_STEP_TAGS = tuple(f"{SCALAR_PREFIX}/{n}" for n in ("tflops_per_device", "hardware_tflops_per_device", "tokens_per_s",
                                                     "tokens_per_s_per_device", "step_time_ms"))
_BREAKDOWN_TAGS = tuple((k, breakdown_tag(k)) for k in BREAKDOWN_PARTS)
_LOST_TAGS = tuple((k, points_lost_tag(k)) for k in BREAKDOWN_PARTS[1:])


def where_to_look(logdir: str) -> str:
    """The lines a script prints after training: the command, the tab and the tags to open.

    >>> print(where_to_look("/tmp/logs").splitlines()[0])
    View it with:  tensorboard --logdir /tmp/logs
    """
    return (f"View it with:  tensorboard --logdir {logdir}\n"
            f"  first screen, tab TIME SERIES: group {HEADLINE_GROUP}: {WATERFALL_TAG} (peak 100 -> achieved MFU, "
            f"MFU points lost per part) and {MFU_TAG}\n"
            f"  and group {BREAKDOWN_GROUP}: one card per bucket, e.g. {breakdown_tag('data_wait')} "
            f"(percent of the step time)\n"
            f"  tab TEXT: {TABLE_TAG} (the window's table, per-rank overlap, stragglers)")


def breakdown_layout() -> dict[str, Any]:
    """The custom-scalar layout: one category, one chart per series (a chart's lines share one colour
    per run, so each bucket gets its own chart, titled with its name and unit)."""
    charts = {"MFU (% of peak)": ["Multiline", [MFU_TAG]], "HFU (% of peak)": ["Multiline", [HFU_TAG]]}
    charts.update({f"{p} (% of step)": ["Multiline", [breakdown_tag(p)]] for p in BREAKDOWN_PARTS})
    charts.update({f"{p}: MFU points lost": ["Multiline", [points_lost_tag(p)]] for p in BREAKDOWN_PARTS[1:]})
    charts["tokens/s"] = ["Multiline", [f"{SCALAR_PREFIX}/tokens_per_s"]]
    return {LAYOUT_TITLE: charts}


def points_lost(fractions: Mapping[str, float], mfu: float) -> dict[str, float]:
    """MFU points each part costs, against the MFU the run would have if the whole step were compute.

    ``ideal = mfu / fractions["compute"]`` (the model-FLOP rate of the compute time itself);
    each non-compute part loses ``ideal · fraction``, so ``ideal − Σ lost = mfu``. Returns the
    losses plus ``"ideal"``; in percentage points.
    """
    compute = fractions.get("compute", 0.0)
    ideal = mfu / compute if compute > 1e-9 else 0.0  # no compute measured: no ideal to lose points from
    out = {p: 100.0 * ideal * fractions.get(p, 0.0) for p in BREAKDOWN_PARTS[1:]}
    out["ideal"] = 100.0 * ideal
    return out


def markdown_table(fractions: Mapping[str, float], mfu: float, step_time_s: float | None = None,
                   title: str | None = None, points: Sequence[Mapping[str, Any]] | None = None) -> str:
    """Markdown tables of the breakdown (short columns, so TensorBoard's TEXT dashboard does not wrap
    them): percent of the step, MFU points lost (against the ideal: compute at its own rate),
    milliseconds per step (if the step time is known); and with ``points`` (:func:`waterfall`) the
    waterfall from the peak: each part's MFU points and what to do about it."""
    lost = points_lost(fractions, mfu)
    head = "| part | % of step | MFU points lost |" + (" ms per step |" if step_time_s else "")
    lines = ([f"**{title}**", ""] if title else []) + [head, "|---|---:|---:|" + ("---:|" if step_time_s else "")]
    for p in BREAKDOWN_PARTS:
        row = f"| {p} | {100 * fractions.get(p, 0.0):.2f} % | {lost.get(p, 0.0):.2f} |" if p != "compute" else \
            f"| {p} | {100 * fractions.get(p, 0.0):.2f} % | (ideal MFU {lost['ideal']:.2f} %) |"
        if step_time_s:
            row += f" {1e3 * step_time_s * fractions.get(p, 0.0):.3f} |"
        lines.append(row)
    lines.append(f"| **achieved MFU** | | **{100 * mfu:.2f} %** |" + (" |" if step_time_s else ""))
    if points:
        lines += ["", "**MFU waterfall from the peak** (MFU points; docs/profiling.md explains each part)", "",
                  "| part | MFU points | what to do |", "|---|---:|---|"]
        for p in points:
            lines.append(f"| {p['part']} | {p['points']:.2f} | {WHAT_TO_DO.get(p['part'], '')} |")
    return "\n".join(lines)


def largest_losses(points: Sequence[Mapping[str, Any]], n: int = 3) -> list[tuple[str, float]]:
    """The ``n`` largest losses of a waterfall (:func:`waterfall`), largest first: ``[(part, points)]``.

    >>> largest_losses(waterfall({"compute": 0.5, "other": 0.5}, {"matmul": 1.0}, {"matmul": 0.25}), 2)
    [('host_other', 50.0), ('matmul_efficiency', 25.0)]
    """
    losses = [(p["part"], float(p["points"])) for p in points if p["part"] in WATERFALL_PARTS]
    return sorted((x for x in losses if x[1] > 0), key=lambda x: -x[1])[:n]


def console_block(points: Sequence[Mapping[str, Any]], title: str = "meshkit MFU") -> str:
    """The console's short block after the first profiled window: the MFU and the three largest losses,
    each with what to do (:data:`WHAT_TO_DO`).

    >>> block = console_block(waterfall({"compute": 0.5, "other": 0.5}, {"matmul": 1.0}, {"matmul": 0.25}))
    >>> for line in block.splitlines():
    ...     print(line[:60])
    meshkit MFU: 25.00 % of peak; the largest losses (MFU points
      host_other 50.00: the host is too slow to feed the device:
      matmul_efficiency 25.00: larger tile-aligned matmuls (hidd
    """
    achieved = next(p["points"] for p in points if p["part"] == "achieved")
    lines = [f"{title}: {achieved:.2f} % of peak; the largest losses (MFU points):"]
    lines += [f"  {part} {pts:.2f}: {WHAT_TO_DO[part]}" for part, pts in largest_losses(points)]
    return "\n".join(lines)


def text_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A wide table as pre-formatted text (a fenced block, columns padded): TensorBoard's TEXT dashboard
    squeezes a wide markdown table until its cells wrap letter by letter; pre-formatted text keeps its
    lines and scrolls sideways instead. The first column is left-aligned, the others right-aligned.

    >>> print(text_table(["rank", "ms"], [[0, "1.50"], [10, "12.25"]]))
    ```
    rank     ms
    ----  -----
    0      1.50
    10    12.25
    ```
    """
    cells = [[str(c) for c in header]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    fmt = lambda r: "  ".join(c.ljust(w) if i == 0 else c.rjust(w)  # noqa: E731
                              for i, (c, w) in enumerate(zip(r, widths))).rstrip()
    lines = [fmt(cells[0]), "  ".join("-" * w for w in widths)] + [fmt(r) for r in cells[1:]]
    return "\n".join(["```"] + lines + ["```"])


def overlap_markdown(result: Mapping[str, Any], max_stragglers: int = 5) -> str:
    """Per-rank overlap and step-model tables (from :func:`meshkit.profiling.overlap.analyze_window`
    or ``analyze``) as pre-formatted text (:func:`text_table`: they are too wide for a markdown table),
    with the straggler verdict (:func:`straggler_lines`) and who waited for whom."""
    cols = ["steps", "compute_ms", "comm_ms", "overlapped_comm_ms", "exposed_comm_ms", "idle_ms", "overlap_pct"]
    ranks = result.get("ranks", {})
    lines = ["per-rank overlap (ms summed over the profiled steps):", "",
             text_table(["rank"] + cols, [[r] + [f"{v[c]:.3f}" if c != "steps" else v[c] for c in cols]
                                          for r, v in ranks.items()])]
    names = list(next(iter(ranks.values()), {}).get("buckets_ms", {}))
    if names:
        rows = [[r] + [f"{v['buckets_ms'][n]:.3f}" for n in names]
                + [", ".join(f"rank {k}: {x:.1f} ms" for k, x in v.get("waiting_for_ms", {}).items()) or "-"]
                for r, v in ranks.items()]
        lines += ["", "step model (ms summed over the profiled steps; buckets partition each step):", "",
                  text_table(["rank"] + names + ["waiting for"], rows)]
    lines += ["", "\n\n".join(straggler_lines(result, max_stragglers, markdown=True))]
    if result.get("partial"):
        lines.append("\n**partial**: " + "; ".join(result.get("problems", [])))
    return "\n".join(lines)


def straggler_lines(result: Mapping[str, Any], max_rows: int = 5, *, markdown: bool = False) -> list[str]:
    """The straggler verdict, the noise floor and the late arrivals of an analysis, one line each: the one
    wording of these facts, for ``meshkit analyze``'s text and the TensorBoard table alike.

    ``result`` is what :func:`meshkit.profiling.overlap.analyze` or ``analyze_window`` returns (``straggler``,
    ``stragglers``, and ``noise_floor_ms`` or per-window ``windows``). ``max_rows`` late arrivals are shown,
    the largest first; ``markdown`` puts collective names in code spans.

    >>> res = {"straggler": {"rank": 1, "caused_ms_per_step": 0.3}, "noise_floor_ms": 0.02, "stragglers": [
    ...     {"collective": "gloo:all_reduce", "group": [0, 1], "rank": 1, "lateness_ms": 0.3, "times_last": 4,
    ...      "instances": 4}]}
    >>> print("\\n".join(straggler_lines(res)))
    straggler: rank 1 (made others wait 0.300 ms per step; noise floor 0.020 ms, the run's own jitter)
    late arrivals above the noise floor, per process group and collective, the largest first:
      late: gloo:all_reduce group [0, 1] rank 1 late by 0.300 ms (last 4 of 4 times)
    """
    verdict = result.get("straggler")
    if "noise_floor_ms" in result:
        floors = [float(result["noise_floor_ms"])]
    else:  # analyze's summary: each profiler window has its own floor
        floors = [float(w["noise_floor_ms"]) for w in result.get("windows", []) if "noise_floor_ms" in w]
    floor = ""
    if floors:
        lo, hi = min(floors), max(floors)
        floor = (f"noise floor {lo:.3f} ms" if hi == lo else f"noise floor {lo:.3f} to {hi:.3f} ms over "
                 f"{len(floors)} windows") + ", the run's own jitter"
    if verdict:
        head = f"straggler: rank {verdict['rank']} (made others wait {verdict['caused_ms_per_step']:.3f} ms per step"
        head += f"; {floor})" if floor else ")"
    else:
        head = "straggler: none above the noise floor" + (f" ({floor})" if floor else "")
    lines = [head]
    late = list(result.get("stragglers", []))
    if late:  # single late arrivals; a straggler is a rank that made the others wait in every step
        lines.append("late arrivals above the noise floor, per process group and collective, the largest first"
                     + (":" if verdict else " (they add up to no straggler):"))
    name = (lambda n: f"`{n}`") if markdown else str  # noqa: E731
    for s in late[:max_rows]:
        where = f" in window {s['window']}" if "window" in s else ""
        lines.append(f"  late: {name(s['collective'])} group {s.get('group', '?')} rank {s['rank']} late by "
                     f"{s['lateness_ms']:.3f} ms (last {s['times_last']} of {s['instances']} times{where})")
    if len(late) > max_rows:
        lines.append(f"  ... and {len(late) - max_rows} more (`meshkit analyze --json` lists them all)")
    return lines


_WATERFALL_SIZE = (720, 405)
"""Pixels (W, H): 16:9 with large type, for where TensorBoard shows it (a TIME SERIES card fits the image
into about 380 × 215 px and the IMAGES dashboard into 350 px of width, both without smoothing)."""
_BLUE, _RED, _GREEN, _INK = (76, 114, 176), (196, 78, 82), (85, 168, 104), (26, 26, 26)


def waterfall_image(points: Sequence[Mapping[str, Any]], title: str = "MFU waterfall") -> np.ndarray:
    """A horizontal waterfall (:func:`waterfall`) as an (H, W, 3) uint8 image, top to bottom: the peak
    (100), the MFU points each part loses (a bar ending where the previous one started; parts that lose
    under 0.005 points are left out, the table lists every part; a part below 0, a gain, is drawn in
    green), the achieved MFU; every bar labelled.

    Drawn with Pillow (a few ms, no matplotlib import): it is rendered in every profiler window, whose
    cost is MFUMonitor's overhead.

    >>> img = waterfall_image(waterfall({"compute": 0.8, "other": 0.2}, {"matmul": 1.0}, {"matmul": 0.4}))
    >>> img.shape, img.dtype.name
    ((405, 720, 3), 'uint8')
    """
    from PIL import Image, ImageDraw, ImageFont

    by = {p["part"]: float(p["points"]) for p in points}
    parts = [p for p in WATERFALL_PARTS if abs(by.get(p, 0.0)) >= 0.005]
    labels = ["peak"] + parts + ["achieved"]
    peak, achieved = by.get("peak", 100.0), by["achieved"]
    # (row label, bar start, bar end, colour, value text), in MFU percent
    rows = [("peak", 0.0, peak, _BLUE, f"{peak:.0f} %")]
    level = peak
    for p in parts:
        x = by[p]
        rows.append((p, min(level - x, level), max(level - x, level), _RED if x > 0 else _GREEN,
                     f"{-x:+.2f}" + (f"  {_hint(WHAT_TO_DO[p])}" if x >= 5 else "")))
        level -= x
    rows.append(("achieved", 0.0, achieved, _GREEN, f"{achieved:.2f} %"))
    size = 24 if len(labels) <= 7 else 20 if len(labels) <= 10 else 16
    font, small = ImageFont.load_default(size=size), ImageFont.load_default(size=size - 4)
    w, h = _WATERFALL_SIZE
    img = Image.new("RGB", (w, h), "white")
    draw = ImageDraw.Draw(img)
    draw.text((w / 2, 4), title, font=small, fill=_INK, anchor="ma")
    draw.text((w / 2, h - 4), "MFU, % of peak (bars: MFU points lost; text: what to try)", font=small, fill=_INK,
              anchor="md")
    left = 14 + max(draw.textlength(label, font=font) for label in labels)
    top, bottom = 10 + size, h - 10 - size
    step = (bottom - top) / len(rows)
    room = w - left - 6  # every bar and its value text fit: the scale is set by the tightest row
    scale = min((room - 4 - draw.textlength(text, font=font)) / max(x1, 1e-9) for _, _, x1, _, text in rows)
    for i, (label, x0, x1, colour, text) in enumerate(rows):
        y = top + (i + 0.5) * step
        draw.rectangle((left + scale * x0, y - 0.35 * step, left + scale * x1, y + 0.35 * step), fill=colour)
        draw.text((left + scale * x1 + 4, y), text, font=font, fill=_INK, anchor="lm")
        draw.text((left - 8, y), label, font=font, fill=_INK, anchor="rm")
    draw.line((left, top, left, bottom), fill=_INK, width=1)
    return np.asarray(img)


def _hint(text: str, width: int = 32) -> str:
    """A what-to-do line's first clause, cut at a word to ``width`` characters (the waterfall's bar text).

    >>> _hint("more DataLoader workers, pin_memory, prefetch_factor"), _hint("overlap or shrink communication: see")
    ('more DataLoader workers', 'overlap or shrink communication')
    """
    clause = re.split(r"[:;,(]", text, maxsplit=1)[0].strip()
    return clause if len(clause) <= width else clause[:width].rsplit(" ", 1)[0] + " ..."


def figure_to_array(fig) -> np.ndarray:
    """Render a matplotlib figure to an (H, W, 3) uint8 array for ``add_image(..., dataformats="HWC")``."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    return np.asarray(canvas.buffer_rgba())[..., :3].copy()


def write_layout(writer: Any) -> None:
    """Register the :data:`LAYOUT_TITLE` custom-scalar layout (once per run)."""
    writer.add_custom_scalars(breakdown_layout())


def write_window(writer: Any, step: int, fractions: Mapping[str, float], mfu: float, step_time_s: float,
                 overlap: Mapping[str, Any] | None = None, gantt: Any = None, *, points: Sequence[Mapping[str, Any]],
                 title: str | None = None, peak_source: str | None = None,
                 exposed_comm_by_axis_ms: Mapping[str, float] | None = None) -> None:
    """A profiled window: the breakdown table (:data:`TABLE_TAG`), the waterfall (:data:`WATERFALL_TAG`,
    from ``points``: :func:`waterfall`, whose ``achieved`` is ``mfu``), its ``MFU_waterfall_points/*``
    scalars, the ``MFU_details/window/*`` scalars (percent), ``MFU_exposed_comm_ms/<axis>`` (if given), all of
    the same window; and (if given) the overlap tables and the pipeline Gantt."""
    title = title or f"MFU breakdown at step {step}"
    text = markdown_table(fractions, mfu, step_time_s, title=title, points=points)
    if peak_source:
        text += f"\n\npeak FLOP/s: {peak_source}"
    if overlap is not None:
        text += "\n\n" + overlap_markdown(overlap)
    writer.add_text(TABLE_TAG, text, step)
    writer.add_image(WATERFALL_TAG, waterfall_image(points, title), step, dataformats="HWC")
    for p in points:
        writer.add_scalar(waterfall_tag(p["part"]), float(p["points"]), step)
    for axis, ms in (exposed_comm_by_axis_ms or {}).items():
        writer.add_scalar(exposed_comm_tag(axis), float(ms), step)
    writer.add_scalar(window_tag("mfu_pct"), 100.0 * mfu, step)
    writer.add_scalar(window_tag("step_time_ms"), 1e3 * step_time_s, step)
    for p in BREAKDOWN_PARTS:
        writer.add_scalar(window_tag(f"breakdown_pct/{p}"), 100.0 * fractions.get(p, 0.0), step)
    if gantt is not None:
        writer.add_image(GANTT_TAG, figure_to_array(gantt), step, dataformats="HWC")
    flush = getattr(writer, "flush", None)
    if flush:
        flush()
