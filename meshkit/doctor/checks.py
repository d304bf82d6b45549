"""The checks: pure functions from numbers (or records) to findings, each testable without a Trainer.

Static checks read the layout, the model and the batch arithmetic; dynamic ones read what a run
measured (per-rank probe waits, batch hashes, the pipeline timeline, torch.profiler traces, kernel
reports). Each dynamic check takes its noise floor from the run's own jitter: the median absolute
deviation (× 1.4826, a standard deviation for normal noise) of the measurement across steps.

Example::

    >>> few_microbatches("1f1b", pp=4, microbatches=4).evidence["needed"]   # 2p (schedules.MICROBATCHES_PER_STAGE)
    8
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from meshkit.doctor.findings import Finding
from meshkit.profiling.overlap import noise_floor
from meshkit.schedules import MICROBATCHES_PER_STAGE, recommended_microbatches, theoretical_bubble
from meshkit.timeline import TimelineRecord

__all__ = [
    "rank_grid",
    "axis_groups",
    "tp_across_nodes",
    "preset_fallback",
    "FsdpUnit",
    "one_fsdp_unit",
    "few_microbatches",
    "dp_overlap",
    "global_batch_changed",
    "mfu_band",
    "unused_parameters",
    "identical_batches",
    "straggler",
    "traced_straggler",
    "pp_unbalanced",
    "zero3_exposed_allgather",
    "low_occupancy",
]

JITTER_K = 4.0
"""A difference counts when it exceeds JITTER_K × the run's own jitter (and :data:`MIN_SHARE` of the step)."""
MIN_SHARE = 0.10
"""... and this share of the typical step (or stage) time: below it nothing is reported."""
WARN_SHARE = 0.25
"""Above the floor, a straggler or stage imbalance costing less than this share of the step is "info" (on a
shared or oversubscribed host, CPU contention alone makes one rank that late); more is a "warning"."""


def _floor(series: Sequence[Sequence[float]], typical: float) -> float:
    """The doctor's rule: max(JITTER_K × median over series of 1.4826·MAD(series), MIN_SHARE × typical)."""
    return noise_floor(series, k=JITTER_K, minimum=MIN_SHARE * typical)


# ------------------------------------------------------------------------------------- layout


def rank_grid(degrees: Mapping[str, int], order: Sequence[str]) -> np.ndarray:
    """Global ranks laid out over the mesh axes in ``order``, as ``init_device_mesh`` does (row-major)."""
    shape = tuple(int(degrees[a]) for a in order)
    return np.arange(int(np.prod(shape))).reshape(shape)


def axis_groups(grid: np.ndarray, order: Sequence[str], axes: Sequence[str]) -> list[list[int]]:
    """The rank groups of the (flattened) ``axes``: ranks differing only in those coordinates."""
    idx = [list(order).index(a) for a in axes]
    rest = [i for i in range(grid.ndim) if i not in idx]
    moved = np.transpose(grid, rest + idx)
    size = int(np.prod([grid.shape[i] for i in idx]))
    return moved.reshape(-1, size).tolist()


def tp_across_nodes(grid: np.ndarray, order: Sequence[str], node_of: Sequence[int]) -> Finding | None:
    """Tensor-parallel groups whose ranks sit on more than one node (``node_of[rank]``)."""
    groups = axis_groups(grid, order, ["tp"])
    if len(groups[0]) < 2:
        return None
    crossing = [g for g in groups if len({node_of[r] for r in g}) > 1]
    if not crossing:
        return None
    per_node = max(sum(1 for n in node_of if n == node) for node in set(node_of))
    g = crossing[0]
    return Finding("tp_across_nodes", "warning", None, {
        "tp": len(g), "devices_per_node": per_node, "groups_crossing": len(crossing), "groups": len(groups),
        "example_group": g, "example_nodes": [int(node_of[r]) for r in g], "order": list(order)},
        f"Keep tp <= {per_node} (the devices of a node) with tp innermost in the mesh order, so each tp group "
        "is consecutive ranks of one node; put pp or dp across nodes.")


def preset_fallback(preset: Any, degrees: Mapping[str, int], num_nodes: int, world_size: int) -> list[Finding]:
    """Axes the preset turns on that "auto" resolved to 1 (``preset``: a :class:`~meshkit.plugins.presets.Preset`)."""
    wanted = [("tp", getattr(preset, "tp", False)), ("cp", getattr(preset, "cp", False)),
              ("dp_replicate", getattr(preset, "replicate", False) and num_nodes > 1),
              ("pp", getattr(preset, "pp", False))]
    per_node = world_size // max(num_nodes, 1)
    out = []
    for axis, on in wanted:
        if on and int(degrees.get(axis, 1)) == 1:
            out.append(Finding("preset_fallback", "warning", None, {
                "preset": getattr(preset, "name", str(preset)), "axis": axis, "resolved": 1,
                "devices_per_node": per_node, "num_nodes": num_nodes, "degrees": dict(degrees)},
                f"The preset turns {axis} on but 'auto' found no size > 1 for {per_node} device(s) per node and this "
                f"model: use a device count per node that {axis} divides (with the model's heads), or pass {axis}= "
                "explicitly."))
    return out


@dataclass(frozen=True)
class FsdpUnit:
    """One FSDP unit as :func:`one_fsdp_unit` reads it: the module path of the ``fully_shard``-ed module
    (``""``: the root), its own parameters (not those of units nested in it; a tied weight counted once, where it
    is first held), and how many of them are embeddings (``nn.Embedding``), the LM head (a ``Linear`` onto the
    vocabulary, untied), entries of a block stack (``blocks`` of them, e.g. ``model.layers.0``), and of a weight
    held by several modules (``tied``: a tied embedding / LM head), counted once."""

    name: str
    parameters: int
    embeddings: int = 0
    lm_head: int = 0
    block_parameters: int = 0
    blocks: int = 0
    tied: int = 0


def one_fsdp_unit(units: Sequence[FsdpUnit], fsdp_enabled: bool, share: float = 0.5) -> Finding | None:
    """FSDP on, but one unit holds more than ``share`` of the parameters: its all-gather is most of the
    model at once, with nothing to overlap it. The finding names that unit and what makes it big:

    - several blocks of a stack in one unit, or no block stack at all: "warning" (wrap per block);
    - one block alone (the blocks are wrapped, one is most of the model): "warning" (split that block);
    - the embeddings / LM head (the blocks are wrapped; a small model's vocabulary outweighs them): "info",
      the model's shape, not a wrapping mistake.

    >>> one_fsdp_unit([FsdpUnit("model", 64064, embeddings=64000), FsdpUnit("model.layers.0", 37000, blocks=1,
    ...               block_parameters=37000), FsdpUnit("model.layers.1", 37000, blocks=1, block_parameters=37000)],
    ...               True) is None  # a tied 1000 x 64 embedding counted once: 46 % of 138,064
    True
    """
    total = sum(u.parameters for u in units)
    if not fsdp_enabled or not units or total == 0:
        return None
    big = max(units, key=lambda u: u.parameters)
    if big.parameters <= share * total:
        return None
    where = f"`{big.name}`" if big.name else "the root module"
    vocab = big.embeddings + big.lm_head
    other = big.parameters - vocab - big.block_parameters
    evidence = {
        "fsdp_units": len(units), "largest_unit": big.name, "largest_unit_share": round(big.parameters / total, 4),
        "largest_unit_parameters": int(big.parameters), "parameters": int(total), "embeddings": int(big.embeddings),
        "lm_head": int(big.lm_head), "tied": int(big.tied), "blocks": int(big.blocks),
        "block_parameters": int(big.block_parameters), "other": int(other)}
    share_txt = f"{big.parameters / total:.0%} of the parameters"
    blocks_wrapped = any(u.blocks for u in units if u is not big)
    if big.blocks == 1 and blocks_wrapped and big.block_parameters > big.parameters / 2:
        return Finding("one_fsdp_unit", "warning", None, {**evidence, "holds": "a block"},
                       f"The block {where} alone holds {share_txt}, so its all-gather has no neighbour to overlap "
                       "with: make the blocks smaller, or fully_shard that block's submodules (attention, MLP) as "
                       "units of their own in configure_model.")
    if blocks_wrapped and big.blocks == 0 and vocab > big.parameters / 2:
        holds = " and ".join(n for n, c in (("the embeddings", big.embeddings), ("the LM head", big.lm_head)) if c)
        holds += f" (a tied weight of {big.tied:,} counted once)" if big.tied else ""
        return Finding("one_fsdp_unit", "info", None, {**evidence, "holds": "embeddings / lm_head"},
                       f"The FSDP unit {where} holds {holds}: {vocab:,} parameters, {share_txt}; the blocks are FSDP "
                       "units of their own and the vocabulary outweighs them at this size (it shrinks as the blocks "
                       "grow). Nothing to fix; to overlap that all-gather too, fully_shard the embedding and the LM "
                       "head as units of their own in configure_model (a tied pair together).")
    what = (f"{big.blocks} blocks of a block stack" if big.blocks >= 2 else
            "the only block of its stack" if big.blocks == 1 else "no repeated blocks meshkit can find")
    return Finding("one_fsdp_unit", "warning", None, {**evidence, "holds": "blocks" if big.blocks else "other"},
                   f"The FSDP unit {where} holds {what} ({share_txt}), so FSDP gathers most of the model at once and "
                   "overlaps nothing: keep two or more blocks in an nn.ModuleList (model.layers), or wrap them "
                   "yourself in configure_model with fully_shard per block.")


# ------------------------------------------------------------------------------ batch arithmetic


def few_microbatches(schedule: str, pp: int, microbatches: int, virtual_stages: int = 1) -> Finding | None:
    """m < 2p (:data:`meshkit.schedules.MICROBATCHES_PER_STAGE`): the pipeline bubble is larger than it needs to be (bubble from :func:`meshkit.schedules.theoretical_bubble`)."""
    need = recommended_microbatches(pp)  # meshkit's one micro-batch rule (schedules.MICROBATCHES_PER_STAGE)
    if pp < 2 or microbatches >= need:
        return None
    now = theoretical_bubble(schedule, pp, microbatches, virtual_stages)
    then = theoretical_bubble(schedule, pp, need, virtual_stages)
    return Finding("few_microbatches", "warning", None, {
        "schedule": schedule, "pp": pp, "microbatches": microbatches, "virtual_stages": virtual_stages,
        "needed": need, "bubble": round(now, 4), f"bubble_at_{MICROBATCHES_PER_STAGE}p": round(then, 4)},
        f"Use m >= {MICROBATCHES_PER_STAGE}p = {need} micro-batches (pp_microbatches=, with a per-rank batch that many micro-batches "
        f"long): the ideal bubble falls from {100 * now:.1f} % to {100 * then:.1f} % of the step.")


def dp_overlap(tokens_per_dp_rank: float, peak_flops: float, bandwidth_gbs: float, dp: int, link: str,
               measured_peak: bool = False, gpu: str | None = None) -> Finding | None:
    """T < F/W (:func:`meshkit.planner.dp_overlap_tokens`): the gradient sync cannot hide behind compute.

    F = ``peak_flops`` × the planner's fitted GEMM efficiency of ``gpu`` (a :mod:`meshkit.hardware` catalog key such
    as ``"a100-80gb"``: :meth:`meshkit.planner.Calibration.gemm_fraction` of ``planner.costs.CALIBRATION``,
    the share the planner itself uses; a GPU without a fitted figure, or None, takes its ``achieved_fraction``);
    W = ``bandwidth_gbs`` of the dp group's ``link``.
    """
    from meshkit.planner import dp_overlap_tokens
    from meshkit.planner.costs import CALIBRATION

    if dp < 2:
        return None
    achieved = CALIBRATION.gemm_fraction(gpu) * peak_flops
    needed = dp_overlap_tokens(achieved, bandwidth_gbs * 1e9)
    if tokens_per_dp_rank >= needed:
        return None
    return Finding("dp_overlap", "info" if measured_peak else "warning", None, {
        "tokens_per_dp_rank": int(tokens_per_dp_rank), "needed_tokens": round(needed), "dp": dp, "link": link,
        "achieved_tflops": round(achieved / 1e12, 4), "bandwidth_gbs": bandwidth_gbs, "gpu": gpu,
        **({"peak": "measured (CPU), link figures nominal"} if measured_peak else {})},
        f"Give each data-parallel rank at least F/W = {needed:.0f} tokens per step (a larger per-rank batch or "
        "longer sequences, or gradient accumulation), or fewer dp ranks on that link, so the gradient sync "
        "hides behind compute.")


def global_batch_changed(previous: Mapping[str, Any], current: Mapping[str, Any]) -> Finding | None:
    """The effective global batch differs from the previous run's in the same log directory."""
    old, new = previous.get("global_batch"), current.get("global_batch")
    if not old or not new or old == new:
        return None
    lr_old, lr_new = previous.get("lr"), current.get("lr")
    same_lr = lr_old is None or lr_new is None or lr_old == lr_new
    ratio = new / old
    return Finding("global_batch_changed", "warning" if same_lr else "info", None, {
        "previous_global_batch": old, "global_batch": new, "ratio": round(ratio, 4), "previous_lr": lr_old,
        "lr": lr_new, "previous_run": previous.get("log_dir")},
        (f"Re-tune the learning rate for the {ratio:g}× batch (linear scaling for SGD: lr × {ratio:g}"
         + (f" = {lr_new * ratio:.3g}" if isinstance(lr_new, (int, float)) else "")
         + f", square root for Adam: × {ratio ** 0.5:.3g}), or keep the old global batch with accumulate_grad_batches.")
        if same_lr else "The learning rate changed with the batch; check the warm-up too.")


def mfu_band(mfu: float, peak_kind: str, peak_source: str = "") -> Finding:
    """Seed 004's reading of MFU; on a measured (CPU) peak it is only information."""
    pct = 100 * mfu
    band = "excellent" if pct > 40 else "good" if pct >= 30 else "below good" if pct >= 20 else "badly wrong"
    severity = "warning" if band == "badly wrong" and peak_kind == "datasheet" else "info"
    note = {} if peak_kind == "datasheet" else {"note": f"the peak is {peak_kind}, not a datasheet one"}
    fix = {"excellent": "Nothing to fix.", "good": "Little to gain; look at the MFU breakdown's largest part.",
           "below good": "Look at the MFU breakdown (exposed comm, bubble, data wait) for the largest loss.",
           "badly wrong": "Something is badly wrong (well below 30 %): read the other findings and the MFU "
                          "breakdown, largest loss first."}[band]
    return Finding("mfu_band", severity, None,
                   {"mfu_pct": round(pct, 2), "band": band, "peak": peak_kind, "peak_source": peak_source, **note}, fix)


# ------------------------------------------------------------------------------------ dynamic


def unused_parameters(names: Sequence[str], numel: int, rank: int | None) -> Finding | None:
    """Trainable parameters that have no gradient after the first backward."""
    if not names:
        return None
    return Finding("unused_parameters", "warning", rank,
                   {"count": len(names), "numel": int(numel), "parameters": list(names[:8])},
                   "Use these parameters in forward, or freeze them (requires_grad=False) or remove them: a gradient "
                   "sync that waits for their gradient hangs (DDP), and they never train.")


def identical_batches(hashes: Mapping[int, Sequence[str]], dp_groups: Sequence[Sequence[int]]) -> Finding | None:
    """Ranks of one data-parallel group whose first batches hash the same (they train on the same data)."""
    same: list[list[int]] = []
    for group in dp_groups:
        by_hash: dict[tuple, list[int]] = {}
        for r in group:
            if hashes.get(r):
                by_hash.setdefault(tuple(hashes[r]), []).append(r)
        same.extend(sorted(g) for g in by_hash.values() if len(g) > 1)
    if not same:
        return None
    return Finding("identical_batches", "warning", None, {
        "dp_size": len(dp_groups[0]), "ranks_with_same_batches": same,
        "batches_hashed": min(len(hashes[r]) for g in same for r in g)},
        "Give each data-parallel rank its own samples: keep Lightning's DistributedSampler "
        "(use_distributed_sampler=True) or shard an IterableDataset by the dp rank "
        "(trainer.strategy.distributed_sampler_kwargs).")


def straggler(waits_ms: Mapping[int, Sequence[float]], step_ms: float) -> Finding | None:
    """The rank that arrives last at the per-step probe, later than the run's noise floor.

    ``waits_ms[rank][k]``: how long ``rank`` waited in the probe of step k. The last to arrive waits
    least, so rank r's lateness in step k is ``max_j waits[j][k] - waits[r][k]``.
    """
    ranks = sorted(waits_ms)
    n = min((len(waits_ms[r]) for r in ranks), default=0)
    if len(ranks) < 2 or n < 2:
        return None
    w = np.array([list(waits_ms[r])[:n] for r in ranks])  # (R, n)
    late = w.max(axis=0, keepdims=True) - w
    med = np.median(late, axis=1)
    worst = int(med.argmax())
    others = [float(np.median(late[i])) for i in range(len(ranks)) if i != worst]
    floor = _floor([late[i].tolist() for i in range(len(ranks)) if i != worst], step_ms)
    excess = float(med[worst]) - statistics.median(others)
    if excess <= floor:
        return None
    severity = "warning" if excess > WARN_SHARE * step_ms else "info"
    return Finding("straggler", severity, ranks[worst], {
        "late_ms": round(float(med[worst]), 3), "others_late_ms": round(statistics.median(others), 3),
        "noise_floor_ms": round(floor, 3), "step_ms": round(step_ms, 3), "steps": n,
        "slowdown_pct": round(100 * excess / max(step_ms - excess, 1e-9), 1)},
        f"Rank {ranks[worst]} arrives {excess:.1f} ms late at the step-boundary probe and the other ranks wait for "
        "it there. The probe cannot see inside a step: a rank that waited in a tp or pp collective for a slower "
        "peer arrives with that peer, so this may be the victim. Profile a few steps (MFUMonitor's profiler "
        "window): the doctor then names the rank `meshkit analyze` names, from who waited for whom.")


def traced_straggler(analysis: Mapping[str, Any]) -> Finding | None:
    """The straggler verdict of :func:`meshkit.profiling.overlap.analyze` (``meshkit analyze``) on the profiler
    traces, as a finding: the same rank, by construction (one function for both)."""
    verdict = analysis.get("straggler")
    if not verdict:
        return None
    rank, caused = int(verdict["rank"]), float(verdict["caused_ms_per_step"])
    steps = [v["wall_ms"] / v["steps"] for v in analysis.get("ranks", {}).values() if v.get("steps")]
    step_ms = statistics.median(steps) if steps else 0.0
    severity = "warning" if step_ms and caused > WARN_SHARE * step_ms else "info"
    return Finding("straggler", severity, rank, {
        "caused_ms_per_step": round(caused, 3), "step_ms": round(step_ms, 3), "source": "profiler traces"},
        f"Rank {rank} makes the other ranks wait {caused:.1f} ms per profiled step (followed through the "
        "collectives they waited in, as `meshkit analyze` does): look at that rank's host (data loading, CPU "
        "contention, thermal throttling, a slow link) or replace it.")


def pp_unbalanced(records: Sequence[TimelineRecord], skip_steps: int = 1) -> Finding | None:
    """Stages whose compute per step exceeds the mean stage by more than the noise floor (pipeline timeline).

    Each stage's time in a step is the sum of its F/B/I/W actions (over its dp replicas); stages are
    compared step by step, as shares of that step's mean stage (a loaded host slows every stage of a
    step alike), and the jitter is that of those per-step shares.
    """
    steps = sorted({r.step for r in records})
    steps = steps[skip_steps:] if len(steps) > skip_steps else steps
    stages = sorted({r.stage for r in records})
    if len(stages) < 2 or not steps:
        return None
    c = np.zeros((len(stages), len(steps)))  # (stages, steps), ms
    si, ki = {s: i for i, s in enumerate(stages)}, {k: i for i, k in enumerate(steps)}
    for r in records:
        if r.step in ki:
            c[si[r.stage], ki[r.step]] += r.duration_ns / 1e6
    rel = c / np.maximum(c.mean(axis=0, keepdims=True), 1e-9) - 1  # share above the step's mean stage
    excess = np.median(rel, axis=1)
    slow = int(excess.argmax())
    stage_ms = {s: float(np.median(c[i])) for i, s in enumerate(stages)}
    mean = statistics.fmean(stage_ms.values())
    floor = _floor(rel.tolist(), 1.0)
    if excess[slow] <= floor:
        return None
    severity = "warning" if excess[slow] > WARN_SHARE else "info"
    return Finding("pp_unbalanced", severity, None, {
        "stage_ms": {s: round(v, 3) for s, v in stage_ms.items()}, "slowest_stage": stages[slow],
        "imbalance_pct": round(100 * (stage_ms[stages[slow]] / mean - 1), 1),
        "rate_lost_pct": round(100 * (1 - mean / stage_ms[stages[slow]]), 1),
        "excess_pct": round(100 * float(excess[slow]), 1), "noise_floor_pct": round(100 * floor, 1),
        "steps": len(steps)},
        f"Move layers off stage {stages[slow]} (pp_split_points=) until every stage's forward+backward time is "
        "equal: the slowest stage sets the pipeline's rate.")


def zero3_exposed_allgather(ranks: Mapping[int, Any], threshold: float = 0.10) -> list[Finding]:
    """All-gather time not hidden behind compute, per rank of CUDA traces (:class:`~meshkit.profiling.trace.RankTrace`)."""
    from meshkit.profiling.trace import Intervals, intersection_measure

    out = []
    for r, rt in sorted(ranks.items()):
        if rt.shape != "cuda" or not rt.step_windows.size:
            continue
        ag = [(s, e) for name, s, e, *_ in rt.collectives if name.lower().replace("_", "") == "allgather"]
        if not ag:
            continue
        gathers = Intervals.union([s for s, _ in ag], [e for _, e in ag])
        lo, hi = rt.step_windows[:, 0], rt.step_windows[:, 1]
        exposed = gathers.measure(lo, hi) - intersection_measure(gathers, rt.compute, lo, hi)
        steps = len(lo)
        wall_ms = float((hi - lo).sum()) / 1e3 / steps
        exp_ms = float(exposed.sum()) / 1e3 / steps
        if wall_ms <= 0 or exp_ms / wall_ms < threshold:
            continue
        out.append(Finding("zero3_exposed_allgather", "warning", int(r), {
            "exposed_allgather_ms_per_step": round(exp_ms, 3), "step_ms": round(wall_ms, 3),
            "fraction": round(exp_ms / wall_ms, 4), "allgathers_per_step": round(len(ag) / steps, 1)},
            "All-gathers wait in front of layers: try ZeRO-2 (reshard_after_forward=False: one all-gather per "
            "step instead of two, if memory fits), fewer FSDP ranks on the slow link (HSDP), or larger blocks."))
    return out


def low_occupancy(reports: Sequence[Any], threshold: float = 0.25) -> list[Finding]:
    """Kernels (:class:`~meshkit.profiling.occupancy.KernelReport`) below ``threshold`` occupancy from
    register or shared-memory pressure, or spilling registers. The fix is the report's own ``hint`` (spills
    first, then occupancy), the wording ``meshkit occupancy`` prints."""
    out = []
    for rep in reports:
        occ = rep.occupancy
        pressure = occ.limiter in ("registers", "shared_memory") and occ.occupancy < threshold
        if not (pressure or rep.spill_bytes > 0):
            continue
        out.append(Finding("low_occupancy", "warning", None, {
            "kernel": rep.kernel, "arch": rep.arch, "occupancy": round(occ.occupancy, 4), "limiter": occ.limiter,
            "registers_per_thread": rep.registers_per_thread, "shared_bytes": rep.shared_bytes,
            "spill_bytes": rep.spill_bytes, "num_warps": rep.num_warps}, rep.hint))
    return out
