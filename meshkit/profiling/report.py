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

BREAKDOWN_PARTS = ("compute", "recompute", "exposed_comm", "bubble", "data_wait", "optimizer", "other")
"""The step's wall time, split: fractions ≥ 0 that sum to 1. Only ``compute`` produces model FLOPs."""
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
    ideal = mfu / compute if compute > 0 else 0.0
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
    """Per-rank overlap table (from :func:`meshkit.profiling.overlap.analyze`) as markdown."""
    cols = ["steps", "compute_ms", "comm_ms", "overlapped_comm_ms", "exposed_comm_ms", "idle_ms", "overlap_pct"]
    lines = ["| rank | " + " | ".join(cols) + " |", "|---|" + "---:|" * len(cols)]
    for r, v in result.get("ranks", {}).items():
        lines.append(f"| {r} | " + " | ".join(f"{v[c]:.3f}" if c != "steps" else str(v[c]) for c in cols) + " |")
    for s in result.get("stragglers", [])[:max_stragglers]:
        lines.append(f"\nstraggler: `{s['collective']}` rank {s['rank']} late by {s['lateness_ms']:.3f} ms "
                     f"({s['times_last']}/{s['instances']} times last)")
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
                 overlap: Mapping[str, Any] | None = None, gantt: Any = None) -> None:
    """A profiled window: the breakdown table, the waterfall, and (if given) overlap table and Gantt."""
    text = markdown_table(fractions, mfu, step_time_s, title=f"MFU breakdown at step {step}")
    if overlap is not None:
        text += "\n\n" + overlap_markdown(overlap)
    writer.add_text(f"{SCALAR_PREFIX}/breakdown_table", text, step)
    writer.add_image(f"{SCALAR_PREFIX}/waterfall", figure_to_array(waterfall_figure(fractions, mfu,
                     f"MFU waterfall, step {step}")), step, dataformats="HWC")
    if gantt is not None:
        writer.add_image(f"{SCALAR_PREFIX}/pipeline_gantt", figure_to_array(gantt), step, dataformats="HWC")
    flush = getattr(writer, "flush", None)
    if flush:
        flush()

