"""TensorBoard output: the "MFU breakdown" custom-scalar layout, markdown tables and figures.

Analysis elsewhere returns plain data; this module only draws and writes it. Every writer
function takes a ``SummaryWriter``-like object (``add_scalar``, ``add_text``, ``add_image``,
``add_custom_scalars``), e.g. ``TensorBoardLogger.experiment``.

Example::

    >>> b = {"compute": 0.6, "recompute": 0.1, "exposed_comm": 0.1, "bubble": 0.0,
    ...      "data_wait": 0.05, "optimizer": 0.05, "other": 0.1}
    >>> print(markdown_table(b, mfu=0.3).splitlines()[0])
    | part | fraction of step | MFU points lost |
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

__all__ = [
    "BREAKDOWN_PARTS",
    "SCALAR_PREFIX",
    "breakdown_layout",
    "points_lost",
    "markdown_table",
    "overlap_markdown",
    "waterfall_figure",
    "figure_to_array",
    "write_layout",
    "write_window",
]

BREAKDOWN_PARTS = ("compute", "recompute", "exposed_comm", "bubble", "data_wait", "optimizer", "validation",
                   "checkpoint", "profiler_overhead", "other")
"""The step's wall time, split: fractions ≥ 0 that sum to 1. Only ``compute`` produces model FLOPs.
``other`` is host time inside forward+backward between ops (and any timer gap); ``profiler_overhead``
is MFUMonitor's own time (starting, stopping, exporting, analysing and writing its windows)."""
SCALAR_PREFIX = "mfu"


def breakdown_layout() -> dict[str, Any]:
    """The custom-scalar layout: one category "MFU breakdown" with three charts."""
    return {
        "MFU breakdown": {
            "MFU and HFU": ["Multiline", [f"{SCALAR_PREFIX}/mfu", f"{SCALAR_PREFIX}/hfu"]],
            "step time split (fractions)": ["Multiline", [f"{SCALAR_PREFIX}/breakdown/{p}" for p in BREAKDOWN_PARTS]],
            "MFU points lost": ["Multiline", [f"{SCALAR_PREFIX}/points_lost/{p}" for p in BREAKDOWN_PARTS[1:]]],
            "throughput": ["Multiline", [f"{SCALAR_PREFIX}/tokens_per_s", f"{SCALAR_PREFIX}/tokens_per_s_per_device"]],
        }
    }


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
                   title: str | None = None) -> str:
    """A markdown table of the breakdown: fraction, milliseconds (if the step time is known), MFU points lost."""
    lost = points_lost(fractions, mfu)
    head = "| part | fraction of step | MFU points lost |" + (" ms per step |" if step_time_s else "")
    lines = ([f"**{title}**", ""] if title else []) + [head, "|---|---:|---:|" + ("---:|" if step_time_s else "")]
    for p in BREAKDOWN_PARTS:
        row = f"| {p} | {100 * fractions.get(p, 0.0):.2f} % | {lost.get(p, 0.0):.2f} |" if p != "compute" else \
            f"| {p} | {100 * fractions.get(p, 0.0):.2f} % | (ideal MFU {lost['ideal']:.2f} %) |"
        if step_time_s:
            row += f" {1e3 * step_time_s * fractions.get(p, 0.0):.3f} |"
        lines.append(row)
    lines.append(f"| **achieved MFU** | | **{100 * mfu:.2f} %** |" + (" |" if step_time_s else ""))
    return "\n".join(lines)


def overlap_markdown(result: Mapping[str, Any], max_stragglers: int = 5) -> str:
    """Per-rank overlap and step-model tables (from :func:`meshkit.profiling.overlap.analyze_window`
    or ``analyze``) as markdown, with the straggler verdict and who waited for whom."""
    cols = ["steps", "compute_ms", "comm_ms", "overlapped_comm_ms", "exposed_comm_ms", "idle_ms", "overlap_pct"]
    lines = ["| rank | " + " | ".join(cols) + " |", "|---|" + "---:|" * len(cols)]
    for r, v in result.get("ranks", {}).items():
        lines.append(f"| {r} | " + " | ".join(f"{v[c]:.3f}" if c != "steps" else str(v[c]) for c in cols) + " |")
    ranks = result.get("ranks", {})
    names = list(next(iter(ranks.values()), {}).get("buckets_ms", {}))
    if names:
        lines += ["", "step model (ms summed over the profiled steps; buckets partition each step):", "",
                  "| rank | " + " | ".join(names) + " | waiting for |", "|---|" + "---:|" * len(names) + "---|"]
        for r, v in ranks.items():
            waits = ", ".join(f"rank {k}: {x:.1f} ms" for k, x in v.get("waiting_for_ms", {}).items()) or "-"
            lines.append(f"| {r} | " + " | ".join(f"{v['buckets_ms'][n]:.3f}" for n in names) + f" | {waits} |")
    verdict = result.get("straggler")
    floor = result.get("noise_floor_ms")
    lines.append("")
    lines.append(f"straggler: rank {verdict['rank']} (made others wait {verdict['caused_ms_per_step']:.1f} ms per step)"
                 if verdict else "straggler: none above the noise floor")
    if floor is not None:
        lines[-1] += f" (noise floor {floor:.3f} ms, the run's own jitter)"
    for s in result.get("stragglers", [])[:max_stragglers]:
        lines.append(f"\nlate: `{s['collective']}` group {s.get('group', '?')} rank {s['rank']} late by "
                     f"{s['lateness_ms']:.3f} ms ({s['times_last']}/{s['instances']} times last)")
    if result.get("partial"):
        lines.append("\n**partial**: " + "; ".join(result.get("problems", [])))
    return "\n".join(lines)


def waterfall_figure(fractions: Mapping[str, float], mfu: float, title: str = "MFU waterfall"):
    """A waterfall: ideal MFU (compute at its own rate) → minus each lost part → achieved MFU."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure

    lost = points_lost(fractions, mfu)
    labels = ["ideal"] + [p for p in BREAKDOWN_PARTS[1:]] + ["achieved"]
    fig = Figure(figsize=(8, 3.6))
    ax = fig.add_subplot(1, 1, 1)
    level = lost["ideal"]
    ax.bar(0, level, color="#4c72b0")
    for i, p in enumerate(BREAKDOWN_PARTS[1:], start=1):
        ax.bar(i, -lost[p], bottom=level, color="#c44e52")
        level -= lost[p]
    ax.bar(len(labels) - 1, 100 * mfu, color="#55a868")
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("MFU (%)")
    ax.set_title(title)
    fig.tight_layout()
    return fig


def figure_to_array(fig) -> np.ndarray:
    """Render a matplotlib figure to an (H, W, 3) uint8 array for ``add_image(..., dataformats="HWC")``."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    return np.asarray(canvas.buffer_rgba())[..., :3].copy()


def write_layout(writer: Any) -> None:
    """Register the "MFU breakdown" custom-scalar layout (once per run)."""
    writer.add_custom_scalars(breakdown_layout())


def write_window(writer: Any, step: int, fractions: Mapping[str, float], mfu: float, step_time_s: float,
                 overlap: Mapping[str, Any] | None = None, gantt: Any = None, *, title: str | None = None,
                 peak_source: str | None = None) -> None:
    """A profiled window: the breakdown table, the waterfall and the ``mfu/window/*`` scalars, all from
    the same ``fractions`` and ``mfu``; and (if given) the overlap table and the pipeline Gantt."""
    title = title or f"MFU breakdown at step {step}"
    text = markdown_table(fractions, mfu, step_time_s, title=title)
    if peak_source:
        text += f"\n\npeak FLOP/s: {peak_source}"
    if overlap is not None:
        text += "\n\n" + overlap_markdown(overlap)
    writer.add_text(f"{SCALAR_PREFIX}/breakdown_table", text, step)
    writer.add_image(f"{SCALAR_PREFIX}/waterfall", figure_to_array(waterfall_figure(fractions, mfu, title)), step,
                     dataformats="HWC")
    writer.add_scalar(f"{SCALAR_PREFIX}/window/mfu", mfu, step)
    writer.add_scalar(f"{SCALAR_PREFIX}/window/step_time_ms", 1e3 * step_time_s, step)
    for p in BREAKDOWN_PARTS:
        writer.add_scalar(f"{SCALAR_PREFIX}/window/breakdown/{p}", fractions.get(p, 0.0), step)
    if gantt is not None:
        writer.add_image(f"{SCALAR_PREFIX}/pipeline_gantt", figure_to_array(gantt), step, dataformats="HWC")
    flush = getattr(writer, "flush", None)
    if flush:
        flush()
