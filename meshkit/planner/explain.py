"""The planner's text: the fixed-width table of layouts and the "why it wins" explanation.

Example::

    >>> from meshkit.planner import Layout, format_table
    >>> format_table([Layout(1, 8, 1, 1, 1, 3, "none", 8, "none", feasible=True)]).splitlines()[0].split()[:3]
    ['#', 'rep', 'shard']
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Sequence

from meshkit.planner.model import FFN_MULTIPLE, GiB

if TYPE_CHECKING:  # the search builds what this text describes; it imports this module, not the reverse
    from meshkit.planner.search import Layout, Plan

__all__ = ["LOSSES", "ERROR_BAND", "explain", "format_table", "header", "compare"]

LOSSES: tuple[str, ...] = ("bubble", "tp", "pp", "cp", "dp", "recompute", "kernels")
"""The overheads a layout's step time adds up, in the order of ``Layout.losses``. "bubble" is the time pipeline
stages idle: the schedule's bubble and the wait for the slowest stage (:func:`~meshkit.planner.stage_imbalance`)."""
ERROR_BAND = 0.05
"""Predicted step times this close (relative) to the fastest are ties: the calibration's held-out rows miss
their published MFU by up to a few points (docs/planner.md), so a smaller difference is not a prediction."""


def explain(plan: Plan) -> str:
    """Why the best layout of ``plan`` wins (against the best layout of another pp/cp/tp shape), or why nothing fits.

    Example::

        >>> from meshkit.planner import ModelSpec, plan, explain
        >>> p = plan(ModelSpec(layers=4, hidden=64, heads=4), seq_len=64, global_batch=8, gpus_per_node=4,
        ...          gpu="cpu", memory_gb=1, peak_tflops=0.1)
        >>> explain(p).startswith("best: ")
        True
    """
    best = plan.best
    if best is None:
        return _why_infeasible(plan)
    text = (f"best: {best.describe()}: {best.step_time_s:.3g} s/step, predicted MFU {best.predicted_mfu:.1%}, "
            f"{best.memory_gb:.1f}/{best.memory_limit_gb:.1f} GB ({best.reason.split(';')[0]})")
    shape = (best.pp, best.cp, best.tp)
    # The runner-up is the best layout with other pp/cp/tp degrees; variants that only split dp
    # differently (dp_replicate vs dp_shard) or change the ZeRO stage are near-ties, counted.
    ties = sum(1 for lay in plan.feasible[1:] if (lay.pp, lay.cp, lay.tp) == shape
               and lay.step_time_s <= best.step_time_s * 1.01)
    if ties:
        text += f"; {ties} variant(s) with the same pp/cp/tp (other dp split or ZeRO stage) are within 1%"
    runner = next((lay for lay in plan.feasible if (lay.pp, lay.cp, lay.tp) != shape), None)
    if runner is None:
        return text + "; no layout with other pp/cp/tp degrees fits."
    gaps = [rl - bl for rl, bl in zip(runner.losses, best.losses)]
    key = LOSSES[gaps.index(max(gaps))]
    why = f"it loses most to {_loss_phrase(runner, key)}" if max(gaps) > 0 else "the difference is in rounding"
    text += (f"; {runner.step_time_s / best.step_time_s:.2f}× faster than the best other shape, "
             f"{runner.describe()} ({runner.step_time_s:.3g} s/step): {why}.")
    close = len({(lay.pp, lay.cp, lay.tp) for lay in plan.feasible
                 if lay.step_time_s <= best.step_time_s * (1 + ERROR_BAND)} - {shape})
    if close:
        text += (f" {close} other pp/cp/tp shape(s) come within {ERROR_BAND:.0%}, inside this model's error: "
                 "any of them is a sound choice.")
    if plan.tie_break:
        text += " " + plan.tie_break
    return text



def _why_infeasible(plan: Plan) -> str:
    """Why no layout fits: the smallest one's memory, what dominates it, and the rules that ruled out others."""
    inp = plan.inputs
    if not plan.layouts:
        rules = "; ".join(f"{rule} ({n} combinations)" for rule, n in plan.rejected.items())
        return f"No layout of {inp['world_size']} GPUs is possible: {rules}."
    smallest = min(plan.layouts, key=lambda lay: lay.memory_gb)
    text = (f"No layout fits: the smallest, {smallest.describe()}, needs {smallest.memory_gb:.1f} GB per GPU "
            f"(states {smallest.model_state_gb:.1f} + activations {smallest.activation_gb:.1f}) but "
            f"{smallest.memory_limit_gb:.1f} GB is usable ({inp['memory_gb']:g} GB less the "
            f"{inp['memory_margin']:.0%} margin).")
    total = inp["params"] * inp["optimizer_bytes"] / GiB
    if total > smallest.memory_limit_gb * inp["world_size"]:
        need = math.ceil(total / smallest.memory_limit_gb)
        text += (f" The model is larger than the cluster: its states alone are {total:.0f} GB "
                 f"({inp['params']:.3g} params × {inp['optimizer_bytes']:g} B), at least {need} GPUs' worth "
                 f"and there are {inp['world_size']}. Use more GPUs or GPUs with more memory.")
    elif smallest.activation_gb >= smallest.model_state_gb:
        text += (" Activations dominate: use activation checkpointing, context parallelism, a shorter "
                 "sequence or a smaller micro-batch.")
    else:
        text += " Model states dominate: shard them further (ZeRO-3), add GPUs, or use GPUs with more memory."
    tp_rule = next((rule for rule in plan.rejected if rule.startswith("tp must divide")), None)
    if tp_rule and smallest.tp == 1:
        text += f" TP cannot help: {tp_rule}."
    return text


_SHORT = {"none": "-", "interleaved": "int1f1b", "interleaved_1f1b": "int1f1b", "zero_bubble": "zb-h1",
          "interleaved_zero_bubble": "zb-h1"}


def _schedule_cell(lay: Layout) -> str:
    name = _SHORT.get(lay.schedule, lay.schedule)
    return name + (f"/v{lay.virtual_stages}" if lay.virtual_stages > 1 else "")


def format_table(layouts: Sequence[Layout]) -> str:
    """A fixed-width table of layouts for logs and terminals (under 100 columns): one line of numbers per layout,
    its reason on the line below.

    Example::

        >>> from meshkit.planner import Layout
        >>> table = format_table([Layout(1, 8, 1, 1, 1, 3, "none", 8, "none", feasible=True)])
        >>> table.splitlines()[0].split()[:6], len(table.splitlines())
        (['#', 'rep', 'shard', 'pp', 'cp', 'tp'], 3)
    """
    head = (f"{'#':<3} {'rep':>3} {'shard':>5} {'pp':>3} {'cp':>3} {'tp':>3} {'zero':>4} {'sched':<10} {'m':>4} "
            f"{'ac':<4} {'mem GB':>6} {'act GB':>6} {'bubble':>6} {'mm eff':>6} {'step s':>7} {'MFU':>6} fits")
    lines = [head]
    for i, lay in enumerate(layouts, 1):
        lines.append(
            f"{i:<3} {lay.dp_replicate:>3} {lay.dp_shard:>5} {lay.pp:>3} {lay.cp:>3} {lay.tp:>3} {lay.zero_stage:>4} "
            f"{_schedule_cell(lay):<10} {lay.microbatches:>4} {lay.activation_checkpointing[:4]:<4} "
            f"{lay.memory_gb:>6.1f} {lay.activation_gb:>6.1f} {lay.bubble_fraction:>6.1%} "
            f"{lay.matmul_efficiency:>6.0%} {lay.step_time_s:>7.3g} {lay.predicted_mfu:>6.1%} "
            f"{'yes' if lay.feasible else 'no'}"
        )
        lines.append(f"    {lay.reason}")
    return "\n".join(lines)


def header(plan: Plan) -> list[str]:
    """The lines above the table: the inputs, how the width and the activations were modelled, and every
    structural rule that removed a whole axis."""
    inp = plan.inputs
    lines = [f"{inp['params'] / 1e9:.1f}B params, seq {inp['seq_len']}, batch {inp['global_batch']} on "
             f"{inp['nodes']}×{inp['gpus_per_node']} {inp['gpu']} ({inp['memory_gb']:.0f} GB, "
             f"{inp['intra_bw_gbs']:g}/{inp['inter_bw_gbs']:g} GB/s at {inp['comm_efficiency']:.0%}, "
             f"{inp['achieved_tflops']:.0f} of {inp['peak_tflops']:.0f} TFLOP/s); "
             f"{len(plan.feasible)} of {len(plan.layouts)} layouts fit"]
    if inp.get("ffn_derived"):
        lines.append(f"ffn={inp['ffn']}: derived from the parameter count and rounded up to a multiple of "
                     f"{FFN_MULTIPLE} as SwiGLU models are built (pass --ffn for the real width)")
    whole = "10" if inp.get("dropout") else "8"  # norms' and matmul inputs 8, plus two dropout masks if any
    lines.append("activations: " + (f"sequence parallel, s·b·h·({whole} + 8 + 6f/h)/t per layer"
                                    if inp.get("sequence_parallel") else
                                    f"no sequence parallelism, s·b·h·({whole} + (8 + 6f/h)/t) per layer")
                 + ("" if inp.get("dropout") else " (no dropout masks)"))
    for axis, rule in plan.removed_axes.items():
        lines.append(f"no layout has {axis} > 1: {rule}")
    return lines


_TERMS = (("compute", "model FLOPs at the large-shape rate"), ("kernels", "kernel shapes"),
          ("recompute", "activation recompute"), ("bubble", "pipeline bubble"), ("tp", "TP comm"),
          ("pp", "PP comm"), ("cp", "CP comm, exposed"), ("dp", "DP comm, exposed"))


def compare(named: Layout, best: Layout | None) -> str:
    """The named layout beside the best one, term by term (seconds per step), and where it ranks.

    Example::

        >>> from meshkit.planner import ModelSpec, plan, compare
        >>> p = plan(ModelSpec(layers=4, hidden=64, heads=4), seq_len=64, global_batch=8, gpus_per_node=4,
        ...          gpu="cpu", memory_gb=1, peak_tflops=0.1, layout="tp=4")
        >>> compare(p.named, p.best).splitlines()[0].startswith("layout tp=4")
        True
    """
    head = (f"layout {named.describe()}: rank {named.rank}, {named.step_time_s:.3g} s/step, predicted MFU "
            f"{named.predicted_mfu:.1%}, {named.memory_gb:.1f}/{named.memory_limit_gb:.1f} GB"
            + ("" if named.feasible else " (does NOT fit)"))
    if best is None:
        return head + "; no layout fits, so there is no best to compare with."
    lines = [head + f"; {named.vs_best:.2f}× the best's step time",
             f"  {'term (s/step)':<38} {'named':>9} {'best':>9} {'named-best':>10}"]
    rows = [("compute", named.ideal_compute_s, best.ideal_compute_s)]
    rows += [(key, named.losses_s[key], best.losses_s[key]) for key, _ in _TERMS[1:]]
    labels = dict(_TERMS)
    for key, a, b in rows:
        lines.append(f"  {labels[key]:<38} {a:>9.3g} {b:>9.3g} {a - b:>+10.3g}")
    lines.append(f"  {'step':<38} {named.step_time_s:>9.3g} {best.step_time_s:>9.3g} "
                 f"{named.step_time_s - best.step_time_s:>+10.3g}")
    lines.append(f"  best: {best.describe()}")
    return "\n".join(lines)


def _loss_phrase(lay: Layout, key: str) -> str:
    if key == "bubble":
        return (f"pipeline bubble {lay.bubble_fraction:.0%} and the wait for the slowest stage ({lay.schedule}, "
                f"pp={lay.pp}, m={lay.microbatches})")
    if key == "tp":
        where = "inside a node" if lay.tp_intra_node else "ACROSS NODES"
        return f"TP collectives {where} (tp={lay.tp}, forward comm/compute {lay.tp_comm_ratio:.2f})"
    if key == "pp":
        return f"PP send/recv (forward comm/compute {lay.pp_comm_ratio:.3f})"
    if key == "cp":
        return f"CP ring traffic {lay.cp_comm_ratio:.2f}× compute, not hidden by attention"
    if key == "dp":
        group = f"ZeRO-{lay.zero_stage}" if lay.zero_stage else "DDP"
        return f"{group} traffic {lay.dp_comm_ratio:.2f}× compute, not hidden"
    if key == "kernels":
        return (f"kernel shapes at cp={lay.cp}, tp={lay.tp} (matmuls at {lay.matmul_efficiency:.0%}, attention at "
                f"{lay.attention_efficiency:.0%} of the large-shape rate)")
    return f"{lay.activation_checkpointing} activation recompute"
