"""The search: every layout of a cluster for a model, evaluated with the cost terms and ranked; :func:`plan`,
:func:`plan_for_world` (a running world, restricted to what the strategy supports) and :func:`auto_nd_layout`
(``strategy="auto_nd"``'s glue).

Mesh order is meshkit's default (``dp_replicate, dp_shard, pp, cp, tp``, outermost first), so an axis stays
inside a node when its degree times the degrees inside it fits in one node.

Example::

    >>> from meshkit.planner import ModelSpec, plan
    >>> p = plan(ModelSpec(layers=4, hidden=64, heads=4), seq_len=64, global_batch=8, nodes=1,
    ...          gpus_per_node=4, gpu="cpu", memory_gb=1, peak_tflops=0.1)
    >>> p.best.world_size
    4
"""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from meshkit.modelspec import read_shape
from meshkit.schedules import canonical_schedule, microbatches_problem
from meshkit.planner.costs import (
    CALIBRATION,
    DEFAULT_RIDGE,
    GPU_TABLE,
    PLANNED_SCHEDULES,
    GpuSpec,
    _peak_flops,
    attention_efficiency,
    Calibration,
    bubble_fraction,
    cp_bytes_per_layer,
    dp_bytes_per_step,
    effective_virtual_stages,
    EAGER_SCORE_BYTES,
    eager_score_seconds,
    elementwise_seconds,
    roofline_efficiency,
    exposed_tp_time,
    gpu_spec,
    inflight_microbatches,
    matmul_efficiency,
    pp_bytes_per_boundary,
    pp_comm_ratio,
    ring_time,
    stage_imbalance,
    tp_bytes_per_layer,
    tp_collectives_per_layer,
    tp_comm_ratio,
)
from meshkit.planner.explain import ERROR_BAND, LOSSES, _loss_phrase, explain, format_table
from meshkit.planner.model import (
    AC_KINDS,
    CHECKPOINTING,
    PIPELINE_SPLITS,
    GiB,
    ModelSpec,
    _check_positive_int,
    activation_bytes_per_layer,
    model_state_bytes,
    stage_layers,
    zero_buffer_bytes,
)

__all__ = [
    "Layout",
    "Plan",
    "plan",
    "plan_for_world",
    "auto_nd_layout",
    "CPU_NOMINAL_TFLOPS",
    "LAYOUT_FIELDS",
    "parse_layout",
]


@dataclass(slots=True)  # ~5,000 per plan: slots make building and ranking them faster
class Layout:
    """One layout of the cluster and what the planner predicts for it."""

    dp_replicate: int
    dp_shard: int
    pp: int
    cp: int
    tp: int
    zero_stage: int
    """ZeRO semantics over the shard group (dp_shard × cp); 0 (DDP) when that group is one rank."""
    schedule: str
    """Pipeline schedule; "none" without a pipeline."""
    microbatches: int
    """Micro-batches per step per data-parallel rank: m = B / (b · dp)."""
    activation_checkpointing: str
    """"none", "selective" or "full"."""
    virtual_stages: int = 1
    """Model chunks per pipeline rank (interleaved schedule); 1 otherwise."""
    pipeline_split: str = "even"
    """How the blocks spread over the stages (:data:`PIPELINE_SPLITS`, :func:`stage_layers`); "even" without a
    pipeline."""
    model_state_gb: float = 0.0
    """Weights, gradients, optimizer state (and ZeRO-3 gather buffers) per GPU."""
    activation_gb: float = 0.0
    """Activations kept for backward on the busiest stage, plus the fp32 logits."""
    memory_gb: float = 0.0
    memory_limit_gb: float = 0.0
    """Usable memory per GPU: the device's less the margin."""
    bubble_fraction: float = 0.0
    tp_comm_ratio: float = 0.0
    """(t−1)·F/(3·h·W): the forward pass's TP comm/compute ratio (:func:`tp_comm_ratio`; F the layout's matmul
    rate, W the TP link). The step time uses the byte counts (whole step: 2/3 of this), not overlapped."""
    pp_comm_ratio: float = 0.0
    """p·F/(12·h·L·W): the forward pass's PP comm/compute ratio (:func:`pp_comm_ratio`; p·v when interleaved)."""
    cp_comm_ratio: float = 0.0
    """Ring-attention traffic time / compute time (before overlap with the attention it feeds)."""
    dp_comm_ratio: float = 0.0
    """Data-parallel communication time / compute time (before overlap)."""
    dp_overlap_ok: bool = True
    """Tokens per dp rank ≥ F/W (:func:`dp_overlap_tokens`): the gradient sync can hide behind compute."""
    tp_intra_node: bool = True
    cross_node_axes: int = 0
    """Parallel axes (of degree > 1) whose collectives cross nodes: the tie rule prefers fewer."""
    matmul_efficiency: float = 1.0
    """Share of the achieved (large-shape) FLOP/s this layout's matmuls sustain (:func:`matmul_efficiency`)."""
    attention_efficiency: float = 1.0
    """The same for its attention kernels (:func:`attention_efficiency`)."""
    compute_s: float = 0.0
    """Seconds of compute per step: model FLOPs and any recompute, at the kernels' rates."""
    step_time_s: float = 0.0
    predicted_mfu: float = 0.0
    feasible: bool = False
    losses: tuple[float, ...] = field(default=(0.0,) * len(LOSSES), repr=False)
    """Seconds each overhead adds to the step, in the order of :data:`LOSSES`."""
    rank: int | None = None
    """Only on a layout named with ``plan(..., layout=...)``: 1 + the layouts of the plan ranked before it."""
    vs_best: float | None = None
    """Only on a named layout: its predicted step time over the best layout's (None when nothing fits)."""

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.pp * self.cp * self.tp

    @property
    def losses_s(self) -> dict[str, float]:
        return dict(zip(LOSSES, self.losses))

    @property
    def reason(self) -> str:
        """One line: why it does not fit, or what costs it the most."""
        if not self.feasible:
            return (f"does not fit: {self.memory_gb:.1f} GB > {self.memory_limit_gb:.1f} GB usable "
                    f"(states {self.model_state_gb:.1f} + activations {self.activation_gb:.1f})")
        mem = f"{self.memory_gb:.1f}/{self.memory_limit_gb:.1f} GB"
        worst = max(self.losses)
        if worst <= 0.02 * self.step_time_s:
            return f"compute-bound, overheads under 2% of the step; {mem}"
        key = LOSSES[self.losses.index(worst)]
        return f"largest loss: {_loss_phrase(self, key)}, {worst / self.step_time_s:.0%} of the step; {mem}"

    @property
    def ideal_compute_s(self) -> float:
        """Seconds the model FLOPs take at the large-shape rate: compute less recompute and kernel-shape losses."""
        return self.compute_s - self.losses[LOSSES.index("recompute")] - self.losses[LOSSES.index("kernels")]

    def spec(self) -> str:
        """This layout as ``plan(..., layout=)`` / ``meshkit plan --layout`` take it (every field; round-trips).

        Example::

            >>> Layout(1, 1, 8, 1, 8, 0, "1f1b", 256, "none").spec()
            'dp_replicate=1,dp_shard=1,pp=8,cp=1,tp=8,zero=0,schedule=1f1b,v=1,m=256,ac=none,split=even'
        """
        return (f"dp_replicate={self.dp_replicate},dp_shard={self.dp_shard},pp={self.pp},cp={self.cp},tp={self.tp},"
                f"zero={self.zero_stage},schedule={self.schedule},v={self.virtual_stages},m={self.microbatches},"
                f"ac={self.activation_checkpointing},split={self.pipeline_split}")

    def describe(self) -> str:
        """Short spelling, e.g. ``dp_shard=128 pp=16 tp=8 zero1 interleaved_1f1b(v=4) m=16 ac=full``."""
        axes = ("dp_replicate", "dp_shard", "pp", "cp", "tp")
        parts = [f"{a}={getattr(self, a)}" for a in axes if getattr(self, a) > 1]
        parts.append(f"zero{self.zero_stage}")
        if self.pp > 1:
            parts.append(self.schedule + (f"(v={self.virtual_stages})" if self.virtual_stages > 1 else ""))
            if self.pipeline_split != "even":
                parts.append(f"split={self.pipeline_split}")
        parts.append(f"m={self.microbatches}")
        if self.activation_checkpointing != "none":
            parts.append(f"ac={self.activation_checkpointing}")
        return " ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        """The JSON record (``meshkit plan --json``)."""
        keys = ("dp_replicate", "dp_shard", "pp", "cp", "tp", "zero_stage", "schedule", "microbatches",
                "virtual_stages", "pipeline_split", "activation_checkpointing", "model_state_gb", "activation_gb", "memory_gb",
                "memory_limit_gb", "bubble_fraction", "tp_comm_ratio", "pp_comm_ratio", "cp_comm_ratio",
                "dp_comm_ratio", "dp_overlap_ok", "tp_intra_node", "cross_node_axes", "matmul_efficiency",
                "attention_efficiency", "compute_s", "step_time_s", "predicted_mfu", "feasible", "reason")
        out = {k: getattr(self, k) for k in keys}
        out["losses_s"] = self.losses_s
        if self.rank is not None:  # a named layout: where it ranks, and how far from the best
            out.update(rank=self.rank, vs_best=self.vs_best)
        return {k: _rounded(v) for k, v in out.items()}

    @property
    def degrees(self) -> dict[str, int]:
        """The five axes' degrees, outermost first (``meshkit.plugins.dims.ParallelDims`` takes them as keywords:
        :func:`meshkit.plugins.dims.auto_nd_dims` builds the strategy's dims from them).

        >>> Layout(1, 4, 2, 1, 8, 3, "1f1b", 8, "none").degrees
        {'dp_replicate': 1, 'dp_shard': 4, 'pp': 2, 'cp': 1, 'tp': 8}
        """
        return {"dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard, "pp": self.pp, "cp": self.cp,
                "tp": self.tp}


def _rounded(value: Any) -> Any:
    if isinstance(value, float):
        return round(value, 6)
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    return value


@dataclass
class _Ctx:
    """Everything resolved once per plan (bytes, seconds, FLOP/s)."""

    model: ModelSpec
    seq: int
    batch: int
    micro: int
    gpn: int
    world: int
    memory: float  # usable bytes per GPU (after the margin)
    intra: tuple[float, float]  # (bandwidth, per-step latency) inside a node
    inter: tuple[float, float]  # across nodes
    peak: float
    achieved: float
    ridge: float  # FLOP/byte, roofline_efficiency's ridge point; 0: no kernel-shape model
    attention_rate: float  # fused attention's large-shape rate as a share of the matmuls'
    tp_overlap: float  # share of the TP collectives hidden behind the GEMMs (exposed_tp_time)
    optimizer_bytes: float
    zero_stages: tuple[int, ...]
    schedules: tuple[str, ...]
    checkpointing: tuple[str, ...]
    virtual_stages: tuple[int, ...]
    splits: tuple[str, ...]
    flash: bool
    sp: bool
    hbm_bw: float  # bytes/s: the elementwise ops' rate
    elementwise: float  # Calibration.elementwise_bytes
    fused_share: float  # Calibration.fused_elementwise
    fused: bool  # the elementwise ops are fused (torch.compile, Megatron-LM's fused kernels)
    dp_overlap: bool  # the DP collectives overlap compute (bucketed, prefetched); False: all of it exposed
    dp_share: float  # Calibration.dp_exposed_share
    interleave_penalty: float
    cp_share: float
    max_pp: int
    max_cp: int
    max_tp: int
    # derived once in __post_init__
    model_flops: float = 0.0
    _times: dict[tuple[int, int], "_Compute"] = field(default_factory=dict)
    _imbalance: dict[tuple[int, str], float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        mdl = self.model
        self.layer_params, self.vocab_params = mdl.layer_params, mdl.vocab_params
        self.model_flops = self.batch * self.seq * mdl.flops_per_token(self.seq)  # the profiler's rule

    def times(self, cp: int, tp: int) -> "_Compute":
        """Compute seconds per GPU per step for a cp × tp split (cached: many layouts share one)."""
        key = (cp, tp)
        if key not in self._times:
            self._times[key] = _Compute.of(self, cp, tp)
        return self._times[key]

    def imbalance(self, pp: int, split: str) -> float:
        """:func:`stage_imbalance` of a ``pp``-stage pipeline split ``split`` (cached)."""
        key = (pp, split)
        if key not in self._imbalance:
            self._imbalance[key] = stage_imbalance(self.model, self.seq, pp, split)
        return self._imbalance[key]

    def link(self, inner: int, degree: int = 1) -> tuple[float, float]:
        """(bandwidth, latency) of an axis of ``degree`` whose groups span ``inner`` consecutive ranks (degree × inner
        degrees). Inside a node: NVLink. Across nodes a collective's rings run one channel per NIC (NCCL): a group
        with k members in each node moves its cross-node traffic over k NICs, k × the per-GPU network bandwidth, up to
        the NVLink it also crosses (the slowest link of the ring). ``degree`` 1 (a point-to-point send): one NIC."""
        if inner <= self.gpn and self.gpn % inner == 0:
            return self.intra
        stride = inner // degree  # ranks between consecutive members
        members = max(1, min(degree, self.gpn // stride)) if stride < self.gpn else 1
        if members == 1:
            return self.inter
        return (min(self.intra[0], members * self.inter[0]), self.inter[1])

    def crosses(self, inner: int) -> bool:
        """True when a group spanning ``inner`` consecutive ranks leaves its node."""
        return not (inner <= self.gpn and self.gpn % inner == 0)


@dataclass
class _Compute:
    """Compute time per GPU per step of one cp × tp split, by activation checkpointing (seconds)."""

    matmul_eff: float
    attention_eff: float
    compute: dict[str, float]  # all of it: model FLOPs and recompute, at the kernels' efficiencies
    recompute: dict[str, float]  # the recomputed forward alone
    kernels: float  # what the efficiencies below 1 add to the model FLOPs' time
    attention_fwd: float  # one layer's attention forward for one micro-batch (ring attention hides hops behind it)

    @classmethod
    def of(cls, ctx: _Ctx, cp: int, tp: int) -> "_Compute":
        mdl, s = ctx.model, ctx.seq
        mm_eff = matmul_efficiency(mdl, ctx.micro * s / cp, tp, ctx.ridge)
        # FlashAttention runs at its fitted share of the matmuls' rate; without it the QKᵀ and PV products are batched
        # GEMMs (s/c × d × s) at the matmuls' rate and the s×s scores stream through memory (eager_score_seconds)
        at_eff = (attention_efficiency(s, cp, ctx.ridge) * ctx.attention_rate if ctx.flash
                  else roofline_efficiency(ctx.ridge, s / cp, mdl.head_dim, s))
        per_gpu = ctx.batch * s / ctx.world / ctx.achieved  # seconds per (FLOP per token) at full efficiency
        attn = mdl.layers * mdl.heads * mdl.head_dim * s  # the PaLM attention term per token is 12 of these
        # non-matmul work: memory-bound, each GPU's tokens through its layers (elementwise_seconds)
        elem = elementwise_seconds(mdl, ctx.batch * s * tp / ctx.world, tp, ctx.sp, ctx.elementwise, ctx.hbm_bw)
        elem *= ctx.fused_share if ctx.fused else 1.0
        # each GPU holds batch·c·t/world sequences' s/c queries of a/t heads: batch/world sequences' worth of scores
        scores = (0.0, 0.0) if ctx.flash else tuple(
            eager_score_seconds(mdl, ctx.batch / ctx.world, s, cp, ctx.hbm_bw, (b,)) for b in EAGER_SCORE_BYTES)
        elem += sum(scores)
        # Recompute per token (Korthikanti et al. 2022 §5): full re-runs the whole forward (2N + 4·L·a·d·s); without
        # FlashAttention selective re-runs the attention core (4·L·a·d·s); with it, selective is the runtime's (every
        # matmul and attention output kept: only the elementwise ops re-run); torchtitan's op-level SAC re-runs wk,
        # wo, w3 (activation_bytes_per_layer); each re-runs the elementwise forward, a third of the elementwise time.
        # The eager attention's score traffic re-runs its forward (EAGER_SCORE_BYTES[0]) whenever the core is recomputed.
        pointwise = (elem - sum(scores)) / 3 + scores[0]
        selective = (0.0, 0.0) if ctx.flash else (0.0, 4.0 * attn)
        extra = {"none": (0.0, 0.0, 0.0), "selective": selective + (pointwise,),
                 "torchtitan_op": (2.0 * mdl.op_sac_recompute_params, 0.0, pointwise),
                 "full": (2.0 * mdl.matmul_params, 4.0 * attn, pointwise)}
        # a causal FlashAttention kernel skips the masked half of the 12·L·a·d·s the FLOP count credits; an eager one
        # computes the whole s × s score matrix and masks it
        skip = 0.5 if ctx.flash else 1.0
        model = (6.0 * mdl.matmul_params / mm_eff + 12.0 * skip * attn / at_eff) * per_gpu + elem
        ideal = (6.0 * mdl.matmul_params + 12.0 * skip * attn) * per_gpu
        recompute = {ac: (mm / mm_eff + skip * at / at_eff) * per_gpu + el for ac, (mm, at, el) in extra.items()}
        # attention forward of one layer, one micro-batch, on one GPU: 4·h·s FLOP per token (PaLM's 12·h·s ÷ 3)
        attention_fwd = 4.0 * skip * mdl.heads * mdl.head_dim * s * (ctx.micro * s / cp) / tp / (ctx.achieved * at_eff)
        return cls(mm_eff, at_eff, {ac: model + r for ac, r in recompute.items()}, recompute, model - ideal,
                   attention_fwd)


@functools.lru_cache(maxsize=256)
def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _structural_rule(ctx: _Ctx, r: int, d: int, p: int, c: int, t: int) -> str | None:
    """Why (r, d, p, c, t) cannot run at all, or None. Each rule is one sentence (counted in Plan.rejected)."""
    m = ctx.model
    if t > ctx.max_tp or p > ctx.max_pp or c > ctx.max_cp:
        return "the caller allows at most " + ", ".join(
            f"{k}={v}" for k, v in (("tp", ctx.max_tp), ("pp", ctx.max_pp), ("cp", ctx.max_cp)) if v < ctx.world)
    if d * c > 1 and not any(z > 0 for z in ctx.zero_stages):
        return "zero_stage=0 (DDP) shards nothing, so dp_shard and cp must be 1 (use dp_replicate)"
    if m.heads % t or m.kv_heads % t or m.ffn % t:
        return (f"tp must divide heads={m.heads}, kv_heads={m.kv_heads} and ffn={m.ffn} "
                "(each TP rank holds whole heads)")
    if c > 1 and ctx.seq % (2 * c):
        return f"cp needs seq_len={ctx.seq} divisible by 2·cp (load-balanced causal ring attention)"
    if p > m.layers:
        return f"pp cannot exceed layers={m.layers} (each stage needs a layer)"
    if ctx.batch % (ctx.micro * r * d):
        return (f"global_batch={ctx.batch} must split into micro_batch={ctx.micro} × dp "
                "(dp = dp_replicate·dp_shard) whole micro-batches")
    if p > 1 and ctx.batch // (ctx.micro * r * d) < p:
        return "pp needs microbatches m = B/(b·dp) ≥ pp, else every stage idles most of the step"
    return None


def _enumerate(ctx: _Ctx) -> tuple[list[Layout], dict[str, int], dict[str, str]]:
    """Every layout of the world, the structural rules with how many degree combinations each ruled out, and the
    axes a rule removed entirely (no combination with that axis > 1 survived) with the rule that removed most."""
    layouts: list[Layout] = []
    rejected: dict[str, int] = {}
    axes = ("pp", "cp", "tp")
    kept = dict.fromkeys(axes, False)
    why: dict[str, dict[str, int]] = {a: {} for a in axes}
    w = ctx.world
    for r in _divisors(w):
        for d in _divisors(w // r):
            for p in _divisors(w // (r * d)):
                for c in _divisors(w // (r * d * p)):
                    t = w // (r * d * p * c)
                    degrees = dict(zip(axes, (p, c, t)))
                    rule = _structural_rule(ctx, r, d, p, c, t)
                    if rule is None:
                        layouts.extend(_layouts_for(ctx, r, d, p, c, t))
                        kept.update({a: True for a, n in degrees.items() if n > 1})
                    else:
                        rejected[rule] = rejected.get(rule, 0) + 1
                        for a, n in degrees.items():
                            if n > 1:
                                why[a][rule] = why[a].get(rule, 0) + 1
    removed = {a: max(why[a], key=why[a].get) for a in axes if not kept[a] and why[a]}
    return layouts, rejected, removed


def _layouts_for(ctx: _Ctx, r: int, d: int, p: int, c: int, t: int) -> list[Layout]:
    """Every (pipeline split, zero stage, schedule, checkpointing) variant of one set of degrees, fully evaluated."""
    mdl, b = ctx.model, ctx.micro
    m = ctx.batch // (b * r * d)
    shard, s_local = d * c, ctx.seq // c
    sp = ctx.sp and t > 1
    ffn = mdl.ffn if mdl.gated_mlp else None  # None: GPT's 4h GELU MLP (Korthikanti's count)
    per_layer = {ac: activation_bytes_per_layer(s_local, b, mdl.hidden, mdl.heads, t, sequence_parallel=sp,
                                                attention_scores=not ctx.flash, checkpointing=ac, ffn=ffn,
                                                kv_heads=mdl.kv_heads, dropout=mdl.dropout)
                 for ac in ctx.checkpointing}
    working = dict.fromkeys(ctx.checkpointing, 0.0)
    # the layer being recomputed holds its full activations once (full, and the op-level selective AC)
    for ac in ("full", "selective", "torchtitan_op") if ctx.flash else ("full",):
        if ac in working:
            working[ac] = activation_bytes_per_layer(s_local, b, mdl.hidden, mdl.heads, t, sequence_parallel=sp,
                                                     attention_scores=False, ffn=ffn, kv_heads=mdl.kv_heads,
                                                     dropout=mdl.dropout)
    logits = 8.0 * s_local * b * mdl.vocab / t  # fp32 logits and their gradient for the micro-batch in the loss
    out: list[Layout] = []
    for split in ctx.splits if p > 1 else ("even",):
        out.extend(_split_variants(ctx, r, d, p, c, t, m, split, per_layer, working, logits))
    return out


def _stage_memory_parts(ctx: _Ctx, p: int, t: int, split: str) -> tuple[int, list[tuple[int, int, float, bool]]]:
    """(blocks on the slowest stage, the stages whose memory can peak: (blocks, pipeline rank, parameters on a GPU,
    holds the loss's logits)).

    "even": one bound for both end stages, the first stage's ⌈L/p⌉ blocks and in-flight micro-batches plus one
    vocabulary matrix and the loss's logits (the first stage holds the embedding, the last the output layer and the
    loss; neither holds more). "balanced" (:func:`stage_layers`): the first stage (embedding, most in flight), the
    second (a full share of blocks, nearly as many in flight) and the last (output layer, logits), each exactly.
    """
    mdl = ctx.model
    end, mid = stage_layers(mdl.layers, p, split)
    vocab, layer = ctx.vocab_params, ctx.layer_params
    if p == 1:
        return end, [(end, 0, (end * layer + (1 if mdl.tied_embeddings else 2) * vocab) / t, True)]
    if split == "even":
        return end, [(end, 0, (end * layer + vocab) / t, True)]
    stages = [(end, 0, (end * layer + vocab) / t, False), (end, p - 1, (end * layer + vocab) / t, True)]
    if p > 2:
        stages.insert(1, (mid, 1, mid * layer / t, False))
    return mid, stages


def _split_variants(ctx: _Ctx, r: int, d: int, p: int, c: int, t: int, m: int, split: str,
                    per_layer: dict[str, float], working: dict[str, float], logits: float) -> list[Layout]:
    """The (zero stage, schedule, checkpointing) variants of one set of degrees and one pipeline split."""
    mdl, b = ctx.model, ctx.micro
    shard, s_local = d * c, ctx.seq // c
    layers_stage, stages = _stage_memory_parts(ctx, p, t, split)
    imbalance = ctx.imbalance(p, split)
    params_gpu = max(params for _, _, params, _ in stages)  # the DP traffic of the stage with the most parameters

    # ---- communication that does not depend on the variant ----
    # TP: 4 (6 with full recompute) ring collectives of 2(t−1) steps per layer per micro-batch; a share
    # ctx.tp_overlap of them hides behind the GEMMs (exposed_tp_time, in the variant loop).
    tp_link = ctx.link(t, t)
    tp_time = {ac: ring_time(tp_bytes_per_layer(s_local, b, mdl.hidden, t, recompute=ac == "full",
                                                parallel_blocks=mdl.parallel_blocks) * layers_stage * m,
                             tp_collectives_per_layer(ac == "full", mdl.parallel_blocks) * layers_stage * m * 2 * (t - 1),
                             *tp_link)
               for ac in ctx.checkpointing}
    times = ctx.times(c, t)
    # CP: ring hops hide behind the attention they feed, one step at a time: in forward each of the c − 1 hops
    # (one K,V shard) overlaps one of the c attention steps; in backward each hop carries K, V, dK, dV (twice
    # the bytes) behind a step of the backward (twice the FLOPs). A short chunk exposes the rest of its hop.
    cp_link = ctx.link(c * t, c)
    cp_layer = cp_bytes_per_layer(ctx.seq, b, mdl.hidden, mdl.heads, mdl.kv_heads, c, t)
    cp_time = ring_time(cp_layer * layers_stage * m, 2 * (c - 1) * layers_stage * m, *cp_link) if c > 1 else 0.0
    cp_exposed = 0.0
    if c > 1:
        kv = cp_layer / (3 * (c - 1))  # one shard
        step_fwd = times.attention_fwd / c
        hops = (max(0.0, ring_time(kv, 1, *cp_link) - step_fwd)
                + max(0.0, ring_time(2 * kv, 1, *cp_link) - 2 * step_fwd))
        cp_exposed = (c - 1) * hops * layers_stage * m
    pp_link = ctx.link(p * c * t)
    # the forward-pass ratios, at the rate this layout's matmuls run
    rate = ctx.achieved * times.matmul_eff
    tp_ratio = tp_comm_ratio(t, mdl.hidden, rate, tp_link[0])
    shard_link, rep_link = ctx.link(d * p * c * t, d), ctx.link(ctx.world, r)
    spans = ((t, t), (c, c * t), (p, p * c * t), (d, d * p * c * t), (r, ctx.world))
    cross = sum(1 for n, inner in spans if n > 1 and ctx.crosses(inner))

    runs: list[tuple[str, int]] = [("none", 1)]
    if p > 1:  # interleaved needs v·p chunks of ≥ 1 slot and an m torch runs (schedules.microbatches_problem)
        slots = mdl.layers + (2 if split == "balanced" else 0)  # the embedding and the output layer take one each
        runs = [(s, 1) for s in ctx.schedules if s != "interleaved_1f1b"] + [
            ("interleaved_1f1b", v) for v in ctx.virtual_stages
            if "interleaved_1f1b" in ctx.schedules and slots >= p * v
            and microbatches_problem("interleaved_1f1b", p, v, m) is None]
    zeros = (0,) if shard == 1 else tuple(z for z in ctx.zero_stages if z > 0)
    # what depends on the checkpointing alone, lightest first (see the loop): compute, exposed TP, CP ratio
    checkpointing = [(ac, per_layer[ac], working[ac], times.compute[ac],
                      exposed_tp_time(tp_time[ac], times.compute[ac], ctx.tp_overlap), times.recompute[ac])
                     for ac in sorted(ctx.checkpointing, key=AC_KINDS.index)]
    limit, limit_gb, intra = ctx.memory, ctx.memory / GiB, tp_link is ctx.intra
    one_stage = len(stages) == 1

    out: list[Layout] = []
    for z in zeros:
        buffer = zero_buffer_bytes(ctx.layer_params / t, z)
        stage_states = [model_state_bytes(params, z, shard, ctx.optimizer_bytes) + buffer
                        for _, _, params, _ in stages]
        # DP: per-block collectives (FSDP / ZeRO buckets ~ one per layer) over the shard group, then the replicas.
        over_shard, over_rep = dp_bytes_per_step(params_gpu, z, shard, r, m)
        scatters = m if z >= 2 else 1
        gathers = 2 * m if z == 3 else (1 if z else 0)
        dp_time = (ring_time(over_shard, layers_stage * (scatters + gathers) * (shard - 1), *shard_link)
                   + ring_time(over_rep, layers_stage * (scatters if z else 1) * 2 * (r - 1), *rep_link))
        for sched, v in runs:
            inflight = [inflight_microbatches(sched, p, m, v, rank) for _, rank, _, _ in stages]
            bubble = bubble_fraction(sched, p, m, v)
            if sched == "interleaved_1f1b" and ctx.interleave_penalty > 0:  # few micro-batches: less than v's gain
                bubble = (p - 1) / (effective_virtual_stages(v, p, m, ctx.interleave_penalty) * m + p - 1)
            # one send forward and one backward per micro-batch per chunk boundary (v per rank when interleaved)
            pp_time = ring_time(pp_bytes_per_boundary(s_local, b, mdl.hidden, t) * m * v, 2 * m * v, *pp_link) \
                if p > 1 else 0.0
            pp_ratio = pp_comm_ratio(p, mdl.hidden, mdl.layers, rate, pp_link[0], v)
            # lightest checkpointing first; once one fits, the heavier ones only add recompute (never faster,
            # and recompute costs more than the tie band), so they are not evaluated: 1.5x fewer layouts
            for ac, act_layer, work, compute, tp_exposed, recompute in checkpointing:
                if one_stage:  # the even split's one bound (first stage's activations, a vocab matrix, the logits)
                    states = stage_states[0]
                    acts = act_layer * stages[0][0] * inflight[0] + work + logits
                else:  # the stage whose states + activations peak highest
                    states, acts = max(((st, act_layer * blocks * n + work + (logits if lg else 0.0))
                                        for st, n, (blocks, _, _, lg) in zip(stage_states, inflight, stages)),
                                       key=sum)
                memory = states + acts
                # every stage waits for the slowest (stage_imbalance), then for the bubble
                bubble_time = compute * (imbalance / (1 - bubble) - 1)
                # ZeRO-3 prefetches forward all-gathers behind forward compute; the rest hides behind backward (2/3),
                # all but a share that never hides (Calibration.dp_exposed_share); past what compute hides it is
                # exposed, and the layout is then not dp_overlap_ok.
                hide = compute * (1.0 if z == 3 else 2.0 / 3.0) if ctx.dp_overlap else 0.0
                dp_exposed = max(ctx.dp_share * dp_time, dp_time - hide)
                overlap_ok = dp_time <= hide
                cp_lost = cp_exposed + ctx.cp_share * cp_time
                step = compute + bubble_time + tp_exposed + pp_time + cp_lost + dp_exposed
                out.append(Layout(
                    r, d, p, c, t, z, sched, m, ac, v, split,
                    model_state_gb=states / GiB, activation_gb=acts / GiB, memory_gb=memory / GiB,
                    memory_limit_gb=limit_gb, bubble_fraction=bubble, tp_comm_ratio=tp_ratio,
                    pp_comm_ratio=pp_ratio, cp_comm_ratio=cp_time / compute, dp_comm_ratio=dp_time / compute,
                    dp_overlap_ok=overlap_ok, tp_intra_node=intra, cross_node_axes=cross,
                    matmul_efficiency=times.matmul_eff,
                    attention_efficiency=times.attention_eff, compute_s=compute, step_time_s=step,
                    predicted_mfu=ctx.model_flops / (ctx.world * ctx.peak * step), feasible=memory <= limit,
                    losses=(bubble_time, tp_exposed, pp_time, cp_lost, dp_exposed, recompute, times.kernels),
                ))
                if memory <= limit:
                    break
    return out


def _rank_key(lay: Layout) -> tuple:
    # Feasible first, fastest first. Exact ties (every overhead hidden) go to the layout that moves the fewest
    # bytes (to 1% of compute; hidden traffic still takes SMs and memory bandwidth), then to fewer
    # parallel axes, smaller tp, lower ZeRO stage, less memory. Infeasible ones follow, closest to fitting first.
    axes = (lay.dp_replicate > 1) + (lay.pp > 1) + (lay.cp > 1) + (lay.tp > 1)
    if not lay.feasible:
        return (True, lay.memory_gb, axes, lay.tp, lay.zero_stage)
    # whole-step traffic / compute from the byte counts (the published TP/PP ratios are the forward pass's)
    tp_pp = (lay.losses[1] + lay.losses[2]) / lay.compute_s if lay.compute_s > 0 else 0.0
    traffic = tp_pp + lay.cp_comm_ratio + lay.dp_comm_ratio
    return (False, round(lay.step_time_s, 9), round(traffic, 2), axes, lay.tp, lay.zero_stage, lay.memory_gb)




_TIGHT = 0.9  # a layout using more than this share of the usable memory has little headroom


def _tie_key(lay: Layout) -> tuple:
    return (lay.memory_gb > _TIGHT * lay.memory_limit_gb, lay.cross_node_axes, lay.step_time_s)


def _break_ties(layouts: list[Layout]) -> str:
    """Among the feasible layouts within :data:`ERROR_BAND` of the fastest, move to the front the one with memory
    headroom (under 90% of the usable memory) and the fewest axes whose collectives cross nodes; say what it did."""
    if not layouts or not layouts[0].feasible:
        return ""
    fastest = layouts[0]
    band = [lay for lay in layouts if lay.feasible and lay.step_time_s <= fastest.step_time_s * (1 + ERROR_BAND)]
    choice = min(band, key=_tie_key)
    if choice is fastest:
        return ""
    layouts.remove(choice)
    layouts.insert(0, choice)
    why = []
    if _tie_key(fastest)[0] and not _tie_key(choice)[0]:
        why.append(f"memory headroom ({choice.memory_gb:.1f} vs {fastest.memory_gb:.1f} of "
                   f"{fastest.memory_limit_gb:.1f} GB)")
    if choice.cross_node_axes < fastest.cross_node_axes:
        why.append(f"fewer axes with cross-node collectives ({choice.cross_node_axes} vs {fastest.cross_node_axes})")
    return (f"tie rule: {len(band)} layouts are within the model's {ERROR_BAND:.0%} error band of the fastest "
            f"({fastest.describe()}, {fastest.step_time_s:.3g} s/step); the first one has "
            f"{' and '.join(why) or 'the same headroom and links'} at {choice.step_time_s / fastest.step_time_s:.3f}× "
            "its predicted step time.")


@dataclass
class Plan:
    """Every layout the planner considered, ranked best first (feasible ones first), and why."""

    layouts: list[Layout]
    rejected: dict[str, int]
    """Structural rules and how many degree combinations each ruled out."""
    inputs: dict[str, Any]
    removed_axes: dict[str, str] = field(default_factory=dict)
    """Axes ("pp", "cp", "tp") a structural rule removed entirely (every degree > 1 ruled out) -> the rule."""
    named: Layout | None = None
    """The layout ``plan(..., layout=...)`` asked about, evaluated, with its ``rank`` and ``vs_best``."""
    tie_break: str = ""
    """What the tie rule (:data:`ERROR_BAND`) did to the top of the ranking, or "" when it changed nothing."""

    @property
    def feasible(self) -> list[Layout]:
        return [lay for lay in self.layouts if lay.feasible]

    @property
    def best(self) -> Layout | None:
        """The fastest feasible layout, or None (then :attr:`explanation` says why)."""
        return self.layouts[0] if self.layouts and self.layouts[0].feasible else None

    @property
    def explanation(self) -> str:
        """Why the best layout wins, or why nothing fits (:func:`meshkit.planner.explain.explain`)."""
        return explain(self)

    def to_dict(self, top: int | None = None) -> dict[str, Any]:
        """The JSON record (``meshkit plan --json``): the first ``top`` layouts, the best, the named one if any."""
        best = self.best
        out = {"layouts": [lay.to_dict() for lay in self.layouts[:top]],
               "best": best.to_dict() if best else None, "explanation": self.explanation,
               "rejected": dict(self.rejected), "removed_axes": dict(self.removed_axes),
               "tie_break": self.tie_break, "inputs": self.inputs}
        if self.named is not None:
            out["layout"] = self.named.to_dict()
        return out

    def table(self, top: int | None = 10) -> str:
        """The first ``top`` layouts as a fixed-width table (:func:`meshkit.planner.explain.format_table`)."""
        return format_table(self.layouts[:top])



def _canonical_schedules(value: Any) -> Any:
    if value is None or value == "auto":
        return value
    values = value if isinstance(value, (list, tuple, set, frozenset)) else (value,)
    return tuple(canonical_schedule(v) for v in values)


def _as_tuple(value: Any, allowed: Sequence[Any], name: str, auto: tuple) -> tuple:
    if value is None or value == "auto":
        return auto
    values = tuple(value) if isinstance(value, (list, tuple, set, frozenset)) else (value,)
    bad = [v for v in values if v not in allowed]
    if bad or not values:
        raise ValueError(f"plan: `{name}={value!r}` must be one of {tuple(allowed)} (or a list of them, or 'auto').")
    return values


def plan(model: Any, *, seq_len: int, global_batch: int, micro_batch: int = 1, nodes: int = 1,
         gpus_per_node: int = 8, gpu: str = "h100-sxm", memory_gb: float | None = None,
         intra_bw_gbs: float | None = None, inter_bw_gbs: float | None = None, intra_latency_us: float = 3.0,
         inter_latency_us: float = 5.0, peak_tflops: float | None = None,
         achieved_tflops: float | None = None, achieved_fraction: float | None = None, memory_margin: float = 0.10,
         optimizer_bytes: float = 16.0, zero_stage: int | Sequence[int] | None = None,
         activation_checkpointing: str | Sequence[str] = "auto", schedule: str | Sequence[str] = "auto",
         virtual_stages: Sequence[int] = (2, 4, 8), pipeline_split: str | Sequence[str] = "even",
         flash_attention: bool = True, sequence_parallel: bool = True,
         dtype: str = "bf16", max_pp: int | None = None, max_cp: int | None = None,
         max_tp: int | None = None, roofline_ridge: float | None = None, ridge_scale: float | None = None,
         comm_efficiency: float | None = None, attention_fraction: float | None = None,
         tp_overlap: float | None = None, layout: str | Mapping[str, Any] | None = None,
         search: bool = True, calibration: Calibration | None = None, fused_elementwise: bool = False,
         hbm_bw_gbs: float | None = None, dp_overlap: bool = True) -> Plan:
    """Enumerate every layout of ``nodes × gpus_per_node`` GPUs for ``model`` and rank them.

    ``model`` is a :class:`ModelSpec`, a meshkit ``LlamaConfig``, a Hugging Face config or a model with
    ``.config``. ``gpu`` is a :data:`GPU_TABLE` name or device string; another device needs ``memory_gb``
    (its links then default to 450 / 50 GB/s). Bandwidths are per GPU per direction (defaults from the
    table: 450 GB/s NVLink, 50 GB/s InfiniBand on H100); ``peak_tflops`` defaults to profiling's dense
    peak for ``gpu`` and ``dtype``; achieved FLOP/s to ``achieved_fraction`` of it: the rate large matmuls
    sustain. A layout's kernels run at that rate times their shape efficiency (:func:`matmul_efficiency`,
    :func:`attention_efficiency`) at the ridge ``ridge_scale`` × ``roofline_ridge`` (FLOP/byte; default the
    dense peak over the GPU's memory bandwidth, 295 on an H100 SXM, :data:`DEFAULT_RIDGE` for a device outside
    the table; 0 turns the shape model off); fused attention at ``attention_fraction`` of the matmuls' rate.
    Collectives run at ``comm_efficiency`` of the link bandwidths; a share ``tp_overlap`` of the TP collectives
    hides behind the GEMMs (:func:`exposed_tp_time`).
    ``achieved_fraction``, ``ridge_scale``, ``attention_fraction``, ``comm_efficiency`` and ``tp_overlap`` default to
    ``calibration`` (:data:`CALIBRATION` when None), fitted to published runs; so do its other terms (the GPU's own
    GEMM efficiency, attention without FlashAttention, the elementwise traffic, DP and CP exposed shares, the
    interleaved bubble with few micro-batches). ``fused_elementwise``: the elementwise ops are fused
    (torch.compile, Megatron-LM's fused kernels). ``dp_overlap=False``: the data-parallel collectives run after the
    backward, none of them behind compute (e.g. a DDP without bucketed overlap); every layout with DP traffic is then
    not ``dp_overlap_ok`` and pays all of it. ``hbm_bw_gbs`` overrides the GPU's memory bandwidth (GB/s; the
    elementwise ops' rate and the default ridge), e.g. torchtitan's H100s with 2.4 TB/s HBM2e. ``zero_stage``, ``schedule`` and
    ``activation_checkpointing`` fix a choice or (None / "auto") let the planner try each.
    ``pipeline_split`` is how a pipeline spreads the blocks (:func:`stage_layers`): "even" (the default), "balanced"
    (the embedding and the output layer take a block's slot each, as Llama 3 trained), a list, or "auto" (both).
    ``flash_attention`` drops the s×s score term from the activations (FlashAttention / SDPA never
    stores it); ``sequence_parallel`` shards TP activations over the sequence (Megatron-LM's and torchtitan's
    sequence parallelism; meshkit's strategy takes ``sequence_parallel=True`` for it); without it the
    activations between TP regions are whole on every TP rank (:func:`activation_bytes_per_layer`).
    ``layout`` names one layout (:func:`parse_layout`: ``"dp_shard=8,pp=8,tp=8"`` or a dict, optional
    ``zero``, ``schedule``, ``v``, ``m``, ``ac``): the plan evaluates exactly it, as :attr:`Plan.named`, with its
    ``rank`` among all layouts and ``vs_best``; a layout that cannot run at all raises ``ValueError``.
    ``search=False`` skips the enumeration (no ranking: the plan holds only the named layout, without ``rank``
    and ``vs_best``; fast, for calibration). Layouts within :data:`ERROR_BAND` of the fastest tie; the first is then the one with the most memory
    headroom and the fewest cross-node collectives (:attr:`Plan.tie_break` says so).
    A plan with no feasible layout has ``best is None`` and an :attr:`Plan.explanation`; malformed
    input raises ``ValueError``.

    Example::

        >>> p = plan(ModelSpec(layers=4, hidden=64, heads=4), seq_len=64, global_batch=8, nodes=1,
        ...          gpus_per_node=4, gpu="cpu", memory_gb=1, peak_tflops=0.1)
        >>> p.best.world_size
        4
    """
    mdl = ModelSpec.from_config(model)
    checks = (("seq_len", seq_len), ("global_batch", global_batch), ("micro_batch", micro_batch), ("nodes", nodes),
              ("gpus_per_node", gpus_per_node)) + tuple(("virtual_stages", v) for v in virtual_stages)
    for name, value in checks:
        _check_positive_int(f"plan: `{name}", value)
    if global_batch % micro_batch:
        raise ValueError(
            f"plan: `global_batch={global_batch}` is not divisible by `micro_batch={micro_batch}`; the global batch "
            f"is a whole number of micro-batches. Use a multiple of {micro_batch}."
        )
    if not 0 <= memory_margin < 1:
        raise ValueError(f"plan: `memory_margin={memory_margin}` must be in [0, 1), e.g. 0.1 for 10%.")
    cal = CALIBRATION if calibration is None else calibration
    try:
        spec: GpuSpec | None = gpu_spec(gpu)
    except ValueError:
        if memory_gb is None:  # a device outside the table needs its memory; links default to 450 / 50 GB/s
            raise
        spec = None
    achieved_fraction = cal.gemm_fraction(spec.name if spec else None) if achieved_fraction is None \
        else achieved_fraction
    ridge_scale = cal.ridge_scale if ridge_scale is None else ridge_scale
    comm_efficiency = cal.comm_efficiency if comm_efficiency is None else comm_efficiency
    attention_fraction = cal.attention_share(spec.name if spec else None) if attention_fraction is None \
        else attention_fraction
    tp_overlap = cal.tp_overlap if tp_overlap is None else tp_overlap
    if not 0 <= tp_overlap <= 1:
        raise ValueError(f"plan: `tp_overlap={tp_overlap}` must be in [0, 1] (the share of TP traffic hidden behind "
                         "the GEMMs; 0: all exposed).")
    for name, value in (("achieved_fraction", achieved_fraction), ("comm_efficiency", comm_efficiency),
                        ("attention_fraction", attention_fraction)):
        if not 0 < value <= 1:
            raise ValueError(f"plan: `{name}={value}` must be in (0, 1], e.g. 0.5.")
    if not ridge_scale >= 0:
        raise ValueError(f"plan: `ridge_scale={ridge_scale}` must be >= 0 (1: the roofline ridge as it is).")
    for name, value in (("max_tp", max_tp), ("max_pp", max_pp), ("max_cp", max_cp)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"plan: `{name}={value!r}` must be an int >= 1 (1 turns the axis off; omit it for no cap).")
    mem = float(memory_gb if memory_gb is not None else spec.memory_gb)
    intra = float(intra_bw_gbs if intra_bw_gbs is not None else spec.intra_bw_gbs if spec else 450.0)
    inter = float(inter_bw_gbs if inter_bw_gbs is not None else spec.inter_bw_gbs if spec else 50.0)
    for name, value in (("memory_gb", mem), ("intra_bw_gbs", intra), ("inter_bw_gbs", inter)):
        if not value > 0:
            raise ValueError(f"plan: `{name}={value}` must be > 0.")
    peak = peak_tflops * 1e12 if peak_tflops is not None else _peak_flops(spec, gpu, dtype)
    achieved = achieved_tflops * 1e12 if achieved_tflops is not None else achieved_fraction * peak
    if not 0 < achieved <= peak:
        raise ValueError(
            f"plan: `achieved_tflops={achieved / 1e12:g}` must be in (0, peak={peak / 1e12:g}] TFLOP/s "
            f"for `gpu={gpu!r}`."
        )
    hbm = float(hbm_bw_gbs) if hbm_bw_gbs is not None else spec.hbm_bw_gbs if spec is not None else None
    if hbm is not None and not hbm > 0:
        raise ValueError(f"plan: `hbm_bw_gbs={hbm_bw_gbs}` must be > 0 (GB/s).")
    if roofline_ridge is None:
        roofline_ridge = peak / (hbm * 1e9) if hbm is not None else DEFAULT_RIDGE
    if not roofline_ridge >= 0:
        raise ValueError(f"plan: `roofline_ridge={roofline_ridge}` must be >= 0 FLOP/byte (0: no kernel-shape model).")
    auto_ac = CHECKPOINTING
    world = nodes * gpus_per_node
    ctx = _Ctx(
        model=mdl, seq=seq_len, batch=global_batch, micro=micro_batch, gpn=gpus_per_node, world=world,
        memory=mem * GiB * (1 - memory_margin), intra=(intra * 1e9 * comm_efficiency, intra_latency_us * 1e-6),
        inter=(inter * 1e9 * comm_efficiency, inter_latency_us * 1e-6), peak=peak, achieved=achieved,
        ridge=float(roofline_ridge) * ridge_scale, attention_rate=attention_fraction, tp_overlap=tp_overlap,
        optimizer_bytes=optimizer_bytes,
        zero_stages=_as_tuple(zero_stage, (0, 1, 2, 3), "zero_stage", (1, 2, 3)),
        schedules=_as_tuple(_canonical_schedules(schedule), PLANNED_SCHEDULES, "schedule", PLANNED_SCHEDULES),
        checkpointing=_as_tuple(activation_checkpointing, AC_KINDS, "activation_checkpointing", auto_ac),
        virtual_stages=tuple(virtual_stages),
        splits=_as_tuple(pipeline_split, PIPELINE_SPLITS, "pipeline_split", PIPELINE_SPLITS),
        flash=flash_attention, sp=sequence_parallel,
        hbm_bw=(hbm if hbm is not None else peak / DEFAULT_RIDGE / 1e9) * 1e9,
        elementwise=cal.elementwise_bytes,
        fused_share=cal.fused_elementwise, fused=fused_elementwise, dp_overlap=dp_overlap,
        dp_share=cal.dp_exposed_share,
        interleave_penalty=cal.interleave_penalty, cp_share=cal.cp_exposed_share,
        max_pp=max_pp or world, max_cp=max_cp or world, max_tp=max_tp or world,
    )
    named_fields = parse_layout(layout) if layout is not None else None
    if search:
        layouts, rejected, removed = _enumerate(ctx)
        layouts.sort(key=_rank_key)
        tie_break = _break_ties(layouts)
    elif named_fields is None:
        raise ValueError("plan: `search=False` evaluates only a named layout; pass `layout=` too.")
    else:
        layouts, rejected, removed, tie_break = [], {}, {}, ""
    inputs = {"params": mdl.total_params, "layers": mdl.layers, "hidden": mdl.hidden, "heads": mdl.heads,
              "kv_heads": mdl.kv_heads, "ffn": mdl.ffn, "vocab": mdl.vocab, "seq_len": seq_len,
              "global_batch": global_batch, "micro_batch": micro_batch, "nodes": nodes,
              "gpus_per_node": gpus_per_node, "world_size": world, "gpu": spec.name if spec else gpu,
              "memory_gb": mem, "memory_margin": memory_margin, "intra_bw_gbs": intra, "inter_bw_gbs": inter,
              "peak_tflops": peak / 1e12, "achieved_tflops": achieved / 1e12, "roofline_ridge": roofline_ridge,
              "ridge_scale": ridge_scale, "comm_efficiency": comm_efficiency,
              "attention_fraction": attention_fraction, "tp_overlap": tp_overlap, "optimizer_bytes": optimizer_bytes,
              "sequence_parallel": sequence_parallel, "flash_attention": flash_attention,
              "fused_elementwise": fused_elementwise, "dp_overlap": dp_overlap, "pipeline_split": list(ctx.splits),
              "dropout": mdl.dropout, "ffn_derived": mdl.ffn_derived}
    result = Plan(layouts, rejected, inputs, removed, tie_break=tie_break)
    if named_fields is not None:
        result.named = _evaluate_named(ctx, named_fields, result)
    return result


LAYOUT_FIELDS: tuple[str, ...] = ("dp_replicate", "dp_shard", "pp", "cp", "tp", "zero", "schedule", "v", "m", "ac",
                                  "split", "sp", "flash", "tp_overlap", "fused", "dp_overlap")
"""The keys of a named layout (:func:`parse_layout`); the degrees default to 1, the rest to the best choice. The
software facts a published run states: ``sp`` (sequence parallel, 0/1), ``flash`` (FlashAttention, 0/1),
``tp_overlap`` (share of TP traffic hidden, 0..1: 0 off, 1 Megatron-LM's --tp-comm-overlap), ``fused``
(elementwise ops fused, 0/1) and ``dp_overlap`` (the DP collectives overlap compute, 0/1: Megatron-LM's
--overlap-grad-reduce, FSDP's prefetch); not named, they are the plan's."""
_FLAGS = ("sp", "flash", "fused", "dp_overlap")
_LAYOUT_ALIASES = {"zero_stage": "zero", "virtual_stages": "v", "microbatches": "m", "activation_checkpointing": "ac",
                   "pipeline_split": "split"}


def parse_layout(layout: str | Mapping[str, Any]) -> dict[str, Any]:
    """The fields of a named layout, from ``"dp_replicate=1,dp_shard=1,pp=8,cp=1,tp=8,zero=1,schedule=1f1b"``
    (``meshkit plan --layout``; :meth:`Layout.spec` writes one) or a dict with the same keys. Degrees not named
    are 1; ``zero``, ``schedule``, ``v`` (stages per rank), ``m`` (micro-batches per step), ``ac`` and ``split``
    (:data:`PIPELINE_SPLITS`) not named are left to the planner (the best variant).

    Example::

        >>> parse_layout("pp=8,tp=8,schedule=1f1b,m=256")
        {'dp_replicate': 1, 'dp_shard': 1, 'pp': 8, 'cp': 1, 'tp': 8, 'schedule': '1f1b', 'm': 256}
    """
    if isinstance(layout, str):
        items = []
        for part in filter(None, (p.strip() for p in layout.split(","))):
            key, eq, value = part.partition("=")
            if not eq:
                raise ValueError(f"plan: `layout={layout!r}`: {part!r} is not key=value. "
                                 f"Write e.g. 'dp_shard=8,pp=8,tp=8' with keys from {LAYOUT_FIELDS}.")
            items.append((key.strip(), value.strip()))
    else:
        items = list(dict(layout).items())
    out: dict[str, Any] = dict.fromkeys(LAYOUT_FIELDS[:5], 1)
    for key, value in items:
        key = _LAYOUT_ALIASES.get(key, key)
        if key not in LAYOUT_FIELDS:
            raise ValueError(f"plan: `layout` key {key!r} is unknown; use {LAYOUT_FIELDS}.")
        if key == "schedule":
            value = value if value == "none" else canonical_schedule(value, "layout: schedule")
            if value not in PLANNED_SCHEDULES + ("none",):
                raise ValueError(f"plan: `layout` has `schedule={value!r}`; the planner models {PLANNED_SCHEDULES}.")
        elif key == "ac":
            if value not in AC_KINDS:
                raise ValueError(f"plan: `layout` has `ac={value!r}`; use one of {AC_KINDS}.")
        elif key == "tp_overlap":
            try:
                value = float(value)
            except (TypeError, ValueError):
                value = -1.0
            if not 0 <= value <= 1:
                raise ValueError(f"plan: `layout` has `tp_overlap={dict(items)[key]!r}`; it must be in [0, 1].")
        elif key in _FLAGS:
            if str(value) not in ("0", "1", "True", "False"):
                raise ValueError(f"plan: `layout` has `{key}={value!r}`; it must be 0 or 1.")
            value = str(value) in ("1", "True")
        elif key == "split":
            if value not in PIPELINE_SPLITS:
                raise ValueError(f"plan: `layout` has `split={value!r}`; use one of {PIPELINE_SPLITS}.")
        else:
            try:
                value = int(value)
            except (TypeError, ValueError):
                value = None
            low = 0 if key == "zero" else 1
            if value is None or value < low or (key == "zero" and value > 3):
                raise ValueError(f"plan: `layout` has `{key}={dict(items)[key] if key in dict(items) else value!r}`; "
                                 f"it must be an int{' in 0..3' if key == 'zero' else ' >= 1'}.")
        out[key] = value
    return out


def _evaluate_named(ctx: _Ctx, fields: dict[str, Any], result: Plan) -> Layout:
    """Exactly the named layout, evaluated with the plan's terms, with its rank among all layouts and vs_best."""
    r, d, p, c, t = (fields[k] for k in LAYOUT_FIELDS[:5])
    spelled = ",".join(f"{k}={v}" for k, v in fields.items())
    if r * d * p * c * t != ctx.world:
        raise ValueError(f"plan: `layout={spelled!r}` has {r}·{d}·{p}·{c}·{t} = {r * d * p * c * t} GPUs, "
                         f"the cluster {ctx.world}. Make dp_replicate·dp_shard·pp·cp·tp equal {ctx.world}.")
    overrides: dict[str, Any] = {"max_pp": ctx.world, "max_cp": ctx.world, "max_tp": ctx.world}
    if "m" in fields:  # m micro-batches per data-parallel rank set the micro-batch size
        micro, rest = divmod(ctx.batch, fields["m"] * r * d)
        if rest or micro < 1:
            raise ValueError(f"plan: `layout={spelled!r}`: global_batch={ctx.batch} is not m·dp = "
                             f"{fields['m']}·{r * d} whole micro-batches. Choose m dividing {ctx.batch // (r * d)}.")
        overrides["micro"] = micro
    shard = d * c
    if "zero" in fields:
        overrides["zero_stages"] = (fields["zero"] if shard > 1 else 0,)  # ZeRO over one rank is DDP
    if "schedule" in fields and p > 1:
        overrides["schedules"] = (fields["schedule"],)
    if "v" in fields:
        overrides["virtual_stages"] = (fields["v"],)
    if "ac" in fields:
        overrides["checkpointing"] = (fields["ac"],)
    if "split" in fields:
        overrides["splits"] = (fields["split"],)
    for key, attr in (("sp", "sp"), ("flash", "flash"), ("tp_overlap", "tp_overlap"), ("fused", "fused"),
                      ("dp_overlap", "dp_overlap")):
        if key in fields:
            overrides[attr] = fields[key]
    sub = dataclasses.replace(ctx, _times={}, _imbalance={}, **overrides)
    rule = _structural_rule(sub, r, d, p, c, t)
    if rule is not None:
        raise ValueError(f"plan: `layout={spelled!r}` cannot run: {rule}.")
    variants = [lay for lay in _layouts_for(sub, r, d, p, c, t)
                if "v" not in fields or lay.virtual_stages == fields["v"] or p == 1]
    if not variants:
        raise ValueError(f"plan: `layout={spelled!r}` has no runnable variant (the interleaved schedule needs "
                         f"layers ≥ pp·v and an m torch runs: schedules.microbatches_problem). Change v, m or the schedule.")
    named = min(variants, key=_rank_key)
    if result.layouts:  # ranked against a search
        key = _rank_key(named)
        named.rank = 1 + sum(1 for lay in result.layouts if _rank_key(lay) < key)
        best = result.best
        named.vs_best = named.step_time_s / best.step_time_s if best is not None else None
    return named


def _host_memory_gb() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GiB
    except (ValueError, OSError, AttributeError):
        return GPU_TABLE["cpu"].memory_gb


# A CPU rank's peak for planning: nominal, so every rank computes the same plan (a measured peak
# differs from rank to rank, and with it, near ties could rank differently and ranks would disagree).
CPU_NOMINAL_TFLOPS = 0.1


def plan_for_world(model: Any, world_size: int, devices_per_node: int, device: str, seq_len: int,
                   global_batch: int, micro_batch: int = 1, *, memory_gb: float | None = None,
                   peak_tflops: float | None = None, zero_stage: int | Sequence[int] = (0, 3),
                   allow_pp: bool = False, allow_cp: bool = False, log: Callable[[str], Any] | None = None,
                   top: int = 10, **kwargs: Any) -> Layout:
    """The best feasible layout for a running world, restricted to what the strategy supports.

    For ``strategy="auto_nd"``: by default only dp_replicate, dp_shard (FSDP2: ZeRO-3 semantics) and tp
    (pp = cp = 1). ``device`` is a GPU name or device string (``torch.cuda.get_device_name()``; pass
    ``memory_gb`` from the device properties), or ``"cpu"``: a CPU rank is planned as a "GPU" with
    1/``devices_per_node`` of the host's memory, the table's nominal gloo bandwidths and a nominal peak
    (:data:`CPU_NOMINAL_TFLOPS`). The answer is a pure function of the arguments, so every rank that
    passes the same ones gets the same layout. ``log`` (e.g. a rank-zero logger's ``info``) receives
    the ranked table (``top`` rows) and the explanation. Other keyword arguments go to :func:`plan`.
    Raises ``ValueError`` with the planner's explanation when nothing fits.

    Example::

        >>> from meshkit.models import LlamaConfig
        >>> lay = plan_for_world(LlamaConfig.tiny(), 4, 4, "cpu", seq_len=32, global_batch=8)
        >>> lay.world_size, lay.pp, lay.cp
        (4, 1, 1)
    """
    _check_positive_int("plan_for_world: `world_size", world_size)
    _check_positive_int("plan_for_world: `devices_per_node", devices_per_node)
    if world_size % devices_per_node:
        raise ValueError(
            f"plan_for_world: `world_size={world_size}` must be a multiple of `devices_per_node={devices_per_node}` "
            "(every node runs the same number of ranks)."
        )
    if str(device).strip().lower() == "cpu":
        memory_gb = memory_gb if memory_gb is not None else _host_memory_gb() / devices_per_node
        peak_tflops = peak_tflops if peak_tflops is not None else CPU_NOMINAL_TFLOPS
    result = plan(model, seq_len=seq_len, global_batch=global_batch, micro_batch=micro_batch,
                  nodes=world_size // devices_per_node, gpus_per_node=devices_per_node, gpu=device,
                  memory_gb=memory_gb, peak_tflops=peak_tflops, zero_stage=zero_stage,
                  max_pp=None if allow_pp else 1, max_cp=None if allow_cp else 1, **kwargs)
    if log is not None:
        log(f"meshkit planner: {len(result.feasible)} of {len(result.layouts)} layouts of {world_size} ranks fit\n"
            f"{result.table(top)}\n{result.explanation}")
    if result.best is None:
        raise ValueError(f"plan_for_world: {result.explanation}")
    return result.best


def auto_nd_layout(model: Any, world_size: int, num_nodes: int, device: str, *, seq_len: int | None = None,
                   global_batch: int | None = None, micro_batch: int = 1, memory_gb: float | None = None,
                   reshard_after_forward: bool = True, sequence_parallel: bool = False,
                   activation_checkpointing: str = "none", log: Callable[[str], Any] | None = None,
                   **kwargs: Any) -> Layout:
    """The layout ``strategy="auto_nd"`` trains with (:func:`meshkit.plugins.dims.auto_nd_dims` turns its
    :attr:`Layout.degrees` into the strategy's ``ParallelDims``).

    Thin glue over :func:`plan_for_world` for the strategy's ``setup_environment``: the planner sees the
    strategy's own settings (FSDP2's ``reshard_after_forward`` = ZeRO-3, else ZeRO-2; sequence
    parallelism; activation checkpointing), ``seq_len`` defaults to the model config's ``max_seq_len``
    (``max_position_embeddings`` for HF), and ``global_batch`` to one ``micro_batch`` per rank (Lightning's
    per-rank batch; ranking by step time at a fixed global batch is ranking by tokens per second).

    Example::

        >>> from meshkit.models import LlamaConfig
        >>> auto_nd_layout(LlamaConfig.tiny(), world_size=4, num_nodes=1, device="cpu", seq_len=64).world_size
        4
    """
    if seq_len is None:
        try:
            seq_len = read_shape(model).max_seq_len
        except ValueError:
            seq_len = None
        if seq_len is None:
            raise ValueError(
                "auto_nd_layout: the model's config has no `max_seq_len` / `max_position_embeddings`; "
                "pass `seq_len=` (tokens per sequence in training)."
            )
    if num_nodes < 1 or world_size % num_nodes:
        raise ValueError(
            f"auto_nd_layout: `world_size={world_size}` must be a multiple of `num_nodes={num_nodes}` "
            "(every node runs the same number of ranks)."
        )
    zero = (0, 3) if reshard_after_forward else (0, 2)
    layout = plan_for_world(model, world_size, world_size // num_nodes, device, seq_len,
                            global_batch or world_size * micro_batch, micro_batch, memory_gb=memory_gb,
                            zero_stage=zero, sequence_parallel=sequence_parallel,
                            activation_checkpointing=activation_checkpointing, log=log, **kwargs)
    return layout

