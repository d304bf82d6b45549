"""The planner's text: the fixed-width table of layouts and the "why it wins" explanation.

Example::

    >>> from meshkit.plugins.planner import Layout, format_table
    >>> format_table([Layout(1, 8, 1, 1, 1, 3, "none", 8, "none", feasible=True)]).splitlines()[0].split()[:3]
    ['#', 'rep', 'shard']
"""

from __future__ import annotations

import math
from typing import Sequence

from meshkit.plugins.planner.model import GiB
from meshkit.plugins.planner.search import LOSSES, Layout, Plan, _loss_phrase

__all__ = ["explain", "format_table"]


def explain(plan: Plan) -> str:
    """Why the best layout of ``plan`` wins (against the best layout of another pp/cp/tp shape), or why nothing fits.

    Example::

        >>> from meshkit.plugins.planner import ModelSpec, plan, explain
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
                 if lay.step_time_s <= best.step_time_s * 1.03} - {shape})
    if close:
        text += (f" {close} other pp/cp/tp shape(s) come within 3%, inside this model's error: "
                 "any of them is a sound choice.")
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


def format_table(layouts: Sequence[Layout]) -> str:
    """A fixed-width table of layouts, one per line, for logs and the CLI.

    Example::

        >>> from meshkit.plugins.planner import Layout
        >>> table = format_table([Layout(1, 8, 1, 1, 1, 3, "none", 8, "none", feasible=True)])
        >>> table.splitlines()[0].split()[:6], len(table.splitlines())
        (['#', 'rep', 'shard', 'pp', 'cp', 'tp'], 2)
    """
    head = (f"{'#':<3} {'rep':>3} {'shard':>5} {'pp':>3} {'cp':>3} {'tp':>3} {'zero':>4} {'sched':<11} {'m':>3}   "
            f"{'ac':<9} {'mem GB':>7} {'act GB':>7} {'bubble':>7} {'tp/comp':>8} {'mm eff':>6} {'step s':>7} "
            f"{'MFU':>5}  fits  reason")
    lines = [head]
    for i, lay in enumerate(layouts, 1):
        lines.append(
            f"{i:<3} {lay.dp_replicate:>3} {lay.dp_shard:>5} {lay.pp:>3} {lay.cp:>3} {lay.tp:>3} {lay.zero_stage:>4} "
            f"{lay.schedule:<11} {lay.microbatches:>3}   {lay.activation_checkpointing:<9} {lay.memory_gb:>7.1f} "
            f"{lay.activation_gb:>7.1f} {lay.bubble_fraction:>7.1%} {lay.tp_comm_ratio:>8.3f} "
            f"{lay.matmul_efficiency:>6.0%} {lay.step_time_s:>7.3g} {lay.predicted_mfu:>5.1%}  "
            f"{'yes' if lay.feasible else 'no ':<4}  {lay.reason}"
        )
    return "\n".join(lines)

