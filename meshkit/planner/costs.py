"""Cost terms of one layout: the GPU's links and peak, communication bytes and times per parallel axis,
the pipeline bubble, and how fast kernels run at the shapes a layout leaves them (a soft roofline).

Units: bytes, seconds, FLOP and FLOP/s, bytes/s per direction; link speeds are decimal GB/s (1e9, as
datasheets give them). Every formula is a small public function citing its source.

Example::

    >>> from meshkit.planner import bubble_fraction, ring_allreduce_bytes
    >>> bubble_fraction("1f1b", 4, 12), ring_allreduce_bytes(1000, 4)
    (0.2, 1500.0)
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from meshkit.hardware import CATALOG, Gpu, find_gpu, gpu
from meshkit.planner.model import ModelSpec, stage_layers
from meshkit.schedules import canonical_schedule, default_virtual_stages, theoretical_bubble

__all__ = [
    "GpuSpec",
    "GPU_TABLE",
    "gpu_spec",
    "PLANNED_SCHEDULES",
    "Calibration",
    "CALIBRATION",
    "inflight_microbatches",
    "bubble_fraction",
    "ring_allreduce_bytes",
    "ring_allgather_bytes",
    "tp_collectives_per_layer",
    "tp_bytes_per_layer",
    "pp_bytes_per_boundary",
    "tp_comm_ratio",
    "pp_comm_ratio",
    "cp_bytes_per_layer",
    "dp_bytes_per_step",
    "ring_time",
    "exposed_tp_time",
    "dp_overlap_tokens",
    "DEFAULT_RIDGE",
    "roofline_efficiency",
    "matmul_efficiency",
    "attention_efficiency",
    "elementwise_seconds",
    "EAGER_SCORE_BYTES",
    "eager_score_seconds",
    "effective_virtual_stages",
    "stage_imbalance",
]

PLANNED_SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b", "interleaved_1f1b", "interleaved_zero_bubble")
"""The pipeline schedules the planner has a cost model for: some of ``meshkit.schedules.SCHEDULE_NAMES``."""
"""The schedules the planner models (:mod:`meshkit.schedules` names; interleaved_zero_bubble at one
stage per rank is ZB-H1). Aliases such as "interleaved" and "zero_bubble" are accepted."""


@dataclass(frozen=True)
class Calibration:
    """The planner's free constants, fitted to published runs (:mod:`meshkit.planner.calibration`;
    values, rows and sources in docs/planner.md)."""

    achieved_fraction: float
    """Share of the dense peak large bf16 matmuls sustain in training (``plan(achieved_fraction=)``)."""
    ridge_scale: float
    """The kernel-shape curve's ridge as a share of the roofline ridge peak / HBM bandwidth: real GEMM tiles
    reuse operands from on-chip memory and overlap loads with math, so a dimension costs less than the additive
    soft roofline says."""
    comm_efficiency: float
    """Share of the datasheet per-direction link bandwidth a ring collective achieves (NCCL bus bandwidth)."""
    attention_fraction: float = 1.0
    """Fused attention's (FlashAttention's) large-shape rate as a share of the matmuls' (its softmax and
    masking run on the non-tensor-core units), for a GPU without its own entry in ``attention_by_gpu``."""
    tp_overlap: float = 0.0
    """Share of the TP collectives hidden behind the GEMMs they feed or follow (Megatron-LM's TP communication
    overlap, torch's async TP), in [0, 1]: 0 all exposed, 1 all hidden. Never more than the compute it hides
    behind (:func:`exposed_tp_time`). The default for a layout that does not state ``tp_overlap=``."""
    gemm_efficiency: tuple[tuple[str, float], ...] = ()
    """Per GPU (``gpu_spec`` key, e.g. ``("a100-80gb", 0.62)``): the share of its dense peak large bf16 matmuls
    sustain; a GPU not listed takes ``achieved_fraction``. Tuned A100 runs reach a larger share than H100 ones
    (H100's peak grew ~3.2x over A100's, its memory bandwidth ~1.6x)."""
    attention_by_gpu: tuple[tuple[str, float], ...] = ()
    """Per GPU (``gpu_spec`` key): FlashAttention's rate as a share of that GPU's matmul rate; a GPU not listed takes
    ``attention_fraction``. The kernels differ by GPU: FlashAttention-2 reaches 50-73 % of the A100's peak (Dao 2023,
    arXiv 2307.08691 §4.1) but only ~35 % of the H100's (Shah et al. 2024, FlashAttention-3, arXiv 2407.08608 §1:
    it uses none of Hopper's wgmma / TMA), while cuBLAS GEMMs use them."""
    elementwise_bytes: float = 0.0
    """Bytes each elementwise / norm op moves per token per layer per unit of width, forward + backward, in units
    of 2 bytes × (h + MLP width): the non-matmul work (norms, residuals, activation, RoPE, dropout), memory-bound at
    the GPU's HBM bandwidth (:func:`elementwise_seconds`). 0: not costed."""
    fused_elementwise: float = 1.0
    """Share of that traffic left when the elementwise ops are fused (``fused=1``: torch.compile, Megatron-LM's
    fused kernels)."""
    dp_exposed_share: float = 0.0
    """Share of the data-parallel traffic that never hides behind compute (the first bucket's gather, the last
    bucket's reduce, the optimizer step waiting for them); the rest hides up to the compute it overlaps."""
    interleave_penalty: float = 0.0
    """κ of the interleaved schedule's bubble with few micro-batches: it gets v_eff = 1 + (v − 1)/(1 + κ·p/m)
    chunks' worth of bubble reduction instead of v (each of the v·p chunk boundaries adds a send and a warm-up
    step that m micro-batches amortize). 0: the theory's v."""
    cp_exposed_share: float = 0.0
    """Share of the ring-attention traffic exposed whatever the overlap (the first hop, the rotation's sync)."""

    def gemm_fraction(self, gpu: str | None) -> float:
        """The GEMM efficiency of ``gpu`` (a ``gpu_spec`` key), else ``achieved_fraction``.

        >>> Calibration(0.5, 0.1, 0.8, gemm_efficiency=(("a100-80gb", 0.6),)).gemm_fraction("a100-80gb")
        0.6
        """
        return dict(self.gemm_efficiency).get(gpu, self.achieved_fraction) if gpu else self.achieved_fraction

    def attention_share(self, gpu: str | None) -> float:
        """FlashAttention's rate over the matmuls' on ``gpu`` (a ``gpu_spec`` key), else ``attention_fraction``.

        >>> Calibration(0.5, 0.1, 0.8, attention_fraction=0.4, attention_by_gpu=(("a100-80gb", 0.9),)).attention_share("h100-sxm")
        0.4
        """
        return dict(self.attention_by_gpu).get(gpu, self.attention_fraction) if gpu else self.attention_fraction


CALIBRATION = Calibration(
    achieved_fraction=0.60, ridge_scale=0.0445, comm_efficiency=0.8, attention_fraction=0.3, tp_overlap=1.0,
    gemm_efficiency=(("a100-80gb", 0.7255), ("h100-sxm", 0.5805)),
    attention_by_gpu=(("a100-80gb", 0.62), ("h100-sxm", 0.34)),
    elementwise_bytes=40.0, fused_elementwise=0.6025, dp_exposed_share=0.2725, interleave_penalty=0.0,
    cp_exposed_share=0.0)
"""The constants plan() uses by default: :func:`meshkit.planner.calibration.fit_constants` on every row of the
published-runs data file (52 runs, six sources, A100 and H100), from :data:`~meshkit.planner.calibration.START`
(benchmarks/planner_calibration.py reproduces it and reports the leave-one-source-out error; docs/planner.md has the
table). ``achieved_fraction`` is the GEMM efficiency of a GPU without rows of its own (0.60, issue 15's value: no row
fits it). ``comm_efficiency``, ``interleave_penalty`` and ``cp_exposed_share`` are START's, not fitted
(:data:`~meshkit.planner.calibration.UNFITTED`: one source alone decides each). ``tp_overlap`` sits on its grid's edge
(1.0): only Llama 3's rows leave it unstated, and they want all of the TP traffic hidden. ``elementwise_bytes`` sits on
its grid's edge too (40): with the grid widened to 80 the fit takes 42 and ``ridge_scale`` drops to its own lower edge
(0.02), out of sample 4.14 RMS against 4.16, so the grid stays (docs/planner.md)."""


@dataclass(frozen=True)
class GpuSpec:
    """Memory and default per-GPU, per-direction link speeds of one accelerator model."""

    name: str
    memory_gb: float
    """Device memory in GiB."""
    hbm_bw_gbs: float
    """Device-memory bandwidth (GB/s): with the dense peak it sets the roofline ridge of :func:`roofline_efficiency`."""
    intra_bw_gbs: float
    """Per-GPU, per-direction bandwidth to GPUs in the same node (GB/s)."""
    inter_bw_gbs: float
    """Per-GPU, per-direction bandwidth to other nodes (GB/s): one NIC per GPU."""
    peak_name: str
    """Name handed to ``meshkit.profiling.flops.peak_flops`` for the dense peak."""
    patterns: tuple[str, ...] = ()
    """Regexes on the upper-cased, space-separated device string (e.g. torch.cuda.get_device_name())."""


def _gpu_spec(row: Gpu) -> GpuSpec:
    return GpuSpec(row.key, row.memory_gb, row.hbm_bw_gbs, row.intra_bw_gbs, row.inter_bw_gbs, row.name,
                   row.patterns)


_PLANNER_FACTS = ("memory_gb", "hbm_bw_gbs", "intra_bw_gbs", "inter_bw_gbs")

GPU_TABLE: dict[str, GpuSpec] = {row.key: _gpu_spec(row) for row in CATALOG if all(
    getattr(row, f) is not None for f in _PLANNER_FACTS)}
"""The rows of meshkit's GPU catalog (:data:`meshkit.hardware.CATALOG`) that know memory and links, by key."""


def gpu_spec(name: str) -> GpuSpec:
    """Look up a GPU by table key (``"h100-sxm"``) or by a device string (``"NVIDIA H100 80GB HBM3"``),
    with the catalog's matcher (:func:`meshkit.hardware.find_gpu`; rows added by ``register_gpu`` included).

    Example::

        >>> gpu_spec("NVIDIA H100 80GB HBM3").name, gpu_spec("h200").memory_gb
        ('h100-sxm', 141)
    """
    row = find_gpu(str(name), has=_PLANNER_FACTS)
    if row is None:
        raise ValueError(
            f"gpu_spec: `gpu={name!r}` is not in the planner's GPU table ({', '.join(GPU_TABLE)}). "
            "Use one of those names, or pass memory_gb=, intra_bw_gbs=, inter_bw_gbs= and peak_tflops= explicitly."
        )
    return _gpu_spec(row)


def _peak_flops(spec: GpuSpec | None, device: str, dtype: str) -> float:
    """Dense peak FLOP/s from profiling's peak table (a measured one for CPU)."""
    from meshkit.profiling.flops import peak_flops  # plugins may import profiling, never the reverse

    return float(peak_flops(spec.peak_name if spec is not None else device, dtype))



@functools.lru_cache(maxsize=4096)  # pure; a search asks the same few thousand times
def inflight_microbatches(schedule: str, pp: int, microbatches: int, virtual_stages: int = 2,
                          stage: int = 0) -> float:
    """Micro-batches whose activations pipeline rank ``stage`` holds at once, in units of that rank's layers
    (the default, the first rank, holds the most).

    GPipe (Huang et al. 2019): all m. 1F1B (Narayanan et al. 2021 §2.2): p − s on stage s, so p on the first.
    Interleaved 1F1B with v chunks per rank: rank s runs (v−1)·p + 2(p−s−1) warm-up chunk forwards and one more
    before its first backward (Megatron-LM's schedule), (v−1)·p + 2(p−s−1) + 1 chunks of 1/v of its layers:
    p·(1 + (p−1−2s)/(p·v)) micro-batches, on the first rank Korthikanti et al. 2022 §4.2.3's p·(1 + (p−1)/(p·v));
    at most m (with m = p the first rank's warm-up covers all m·v chunks: every forward runs first).
    Zero bubble ZB-H1 (Qi et al. 2023 §3): the same peak as 1F1B. No pipeline: one micro-batch.

    >>> inflight_microbatches("1f1b", 4, 16), inflight_microbatches("interleaved", 4, 16, 2)
    (4, 5.5)
    >>> inflight_microbatches("1f1b", 4, 16, stage=3), inflight_microbatches("interleaved", 4, 16, 2, stage=3)
    (1, 2.5)
    """
    if pp == 1 or schedule == "none":
        return 1
    name = canonical_schedule(schedule)
    if name == "gpipe":
        return microbatches
    if name in ("1f1b", "interleaved_zero_bubble"):
        return min(pp - stage, microbatches)
    if name == "interleaved_1f1b":  # never more than all m micro-batches (warm-up ≥ m·v chunks: all forwards first)
        return min(microbatches, pp * (1 + (pp - 1 - 2 * stage) / (pp * virtual_stages)))
    raise ValueError(f"inflight_microbatches: `schedule={schedule!r}` has no activation model; use one of {PLANNED_SCHEDULES}.")


@functools.lru_cache(maxsize=4096)
def bubble_fraction(schedule: str, pp: int, microbatches: int, virtual_stages: int | None = None) -> float:
    """Share of a step each stage sits idle in the pipeline bubble (bubble / (work + bubble)):
    :func:`meshkit.schedules.theoretical_bubble` (forward = input-grad = weight-grad time), 0 without a pipeline.

    ``virtual_stages`` None: 2 for interleaved 1F1B, 1 for the single-stage schedules and ZB-H1 ("zero_bubble").

    >>> bubble_fraction("1f1b", 4, 12)   # 3 / (12 + 3)
    0.2
    """
    if pp == 1 or schedule == "none":
        return 0.0
    v = default_virtual_stages(schedule) if virtual_stages is None else virtual_stages
    return theoretical_bubble(schedule, pp, microbatches, v)


def ring_allreduce_bytes(size_bytes: float, n: int) -> float:
    """Bytes each rank sends in a ring all-reduce of ``size_bytes``: 2(N−1)/N·S
    (Patarasuk & Yuan 2009; NCCL's "bus bandwidth" uses the same factor).

    >>> ring_allreduce_bytes(1000, 4)
    1500.0
    """
    return 2 * (n - 1) / n * size_bytes if n > 1 else 0.0


def ring_allgather_bytes(size_bytes: float, n: int) -> float:
    """Bytes each rank sends in a ring all-gather (or reduce-scatter) whose full result is ``size_bytes``:
    (N−1)/N·S (Thakur, Rabenseifner & Gropp 2005, ring algorithm).

    >>> ring_allgather_bytes(1000, 4)
    750.0
    """
    return (n - 1) / n * size_bytes if n > 1 else 0.0


def tp_collectives_per_layer(recompute: bool = False, parallel_blocks: bool = False) -> int:
    """TP collectives (all-reduces, or all-gather + reduce-scatter pairs under sequence parallelism) one layer runs
    per micro-batch: 2 in forward (after attention, after the MLP) and 2 in backward (Shoeybi et al. 2019 §3), the
    forward's again with full recomputation; a parallel block (attention and MLP summed before one reduction: PaLM
    §2, GPT-J) runs one per pass instead of two, half as many.

    >>> tp_collectives_per_layer(), tp_collectives_per_layer(True), tp_collectives_per_layer(True, True)
    (4, 6, 3)
    """
    count = 6 if recompute else 4
    return count // 2 if parallel_blocks else count


def tp_bytes_per_layer(seq: int, micro_batch: int, hidden: int, tp: int, *, act_bytes: float = 2.0,
                       recompute: bool = False, parallel_blocks: bool = False) -> float:
    """Bytes each TP rank sends per transformer layer per micro-batch.

    Megatron-LM (Shoeybi et al. 2019 §3, Fig. 4): two all-reduces of the s·b·h activation in forward
    (after attention and after the MLP) and two in backward; sequence parallelism (Korthikanti et al. 2022
    §4.2.2) swaps each for an all-gather + reduce-scatter, the same bytes. Full recomputation repeats
    the forward's two; a parallel block half of them (:func:`tp_collectives_per_layer`). Each:
    ring_allreduce_bytes(s·b·h·act_bytes, t). Over a step of 12h²-parameter
    blocks that is a comm/compute ratio of 2(t−1)·F/(9·h·W); :func:`tp_comm_ratio` publishes the forward
    pass's (t−1)·F/(3·h·W), 1.5× that.

    >>> tp_bytes_per_layer(1024, 1, 4096, 8) / 2**20   # 4 · 2·7/8 · 8 MiB
    56.0
    """
    collectives = tp_collectives_per_layer(recompute, parallel_blocks)
    return collectives * ring_allreduce_bytes(float(seq) * micro_batch * hidden * act_bytes, tp)


def pp_bytes_per_boundary(seq: int, micro_batch: int, hidden: int, tp: int = 1, *, act_bytes: float = 2.0) -> float:
    """Bytes one pipeline stage sends across one stage boundary per micro-batch: its output activation
    forward and the input gradient backward, s·b·h·act_bytes each, split over the t TP ranks
    (Narayanan et al. 2021 §4.1, scatter/gather optimization; sequence parallelism shards it the same way).

    Over a whole step this is 4h/t bytes per token per boundary against 72h²·(L/p)/t FLOP per token on a
    stage of 12h²-parameter layers, a ratio of p·F/(18·h·L·W); :func:`pp_comm_ratio` publishes the
    forward pass's p·F/(12·h·L·W), 1.5× that.

    >>> pp_bytes_per_boundary(4096, 1, 8192, 8) / 2**20   # 2 · 64 MiB / 8
    16.0
    """
    return 2 * float(seq) * micro_batch * hidden * act_bytes / tp


def tp_comm_ratio(tp: int, hidden: int, achieved_flops: float, bandwidth: float) -> float:
    """TP communication time over compute time, (t−1)·F/(3·h·W) (the issue's convention; 0 without TP).

    This is the forward pass of a block of 12h² parameters: per token each TP rank does 2·12h²/t = 24h²/t
    FLOP and sends two all-reduces (or all-gather + reduce-scatter pairs) of its 2h-byte bf16 activation,
    2 · 2(t−1)/t · 2h = 8h(t−1)/t bytes: (8h(t−1)/t)/W ÷ (24h²/t)/F = (t−1)·F/(3·h·W). Backward moves
    the same 8h(t−1)/t bytes against twice the FLOPs (48h²/t), so over the whole step the ratio
    :func:`tp_bytes_per_layer` implies is 16h(t−1)/t ÷ 72h²/t = 2(t−1)·F/(9·h·W), 2/3 of this one: that
    1.5× is the only difference (same bf16 activations, same ring collectives). The same number is also
    the whole step with full recomputation's two extra forward all-reduces (6 in all, 24h(t−1)/t bytes)
    counted against the model's 72h²/t FLOP. The step-time model uses the byte counts, not this ratio.
    ``achieved_flops`` is the rate the layout's matmuls run at (F × :func:`matmul_efficiency` in a plan);
    ``bandwidth`` the TP group's link.

    >>> round(tp_comm_ratio(8, 8192, 400e12, 450e9), 4)   # 7 · 400e12 / (3 · 8192 · 450e9)
    0.2532
    """
    return (tp - 1) * achieved_flops / (3 * hidden * bandwidth)


def pp_comm_ratio(pp: int, hidden: int, layers: int, achieved_flops: float, bandwidth: float,
                  virtual_stages: int = 1) -> float:
    """PP communication time over compute time, p·F/(12·h·L·W) (the issue's convention; 0 without PP).

    The forward pass of a stage of L/p blocks of 12h² parameters: per token each rank sends its 2h/t-byte
    share of the bf16 activation across the boundary and does 24h²·(L/p)/t FLOP:
    (2h/t)/W ÷ (24h²L/(p·t))/F = p·F/(12·h·L·W). Backward sends the same bytes (the gradient) against
    twice the FLOPs, so the whole-step ratio behind :func:`pp_bytes_per_boundary` is p·F/(18·h·L·W), 2/3
    of this one (the same 1.5× as :func:`tp_comm_ratio`). With the interleaved schedule each rank holds
    v chunks of L/(p·v) blocks and the activation crosses v boundaries per rank, so p becomes p·v
    (Narayanan et al. 2021 §2.2.2: interleaving multiplies the communication by v).

    >>> round(pp_comm_ratio(16, 16384, 126, 400e12, 50e9), 5)   # 16 · 400e12 / (12 · 16384 · 126 · 50e9)
    0.00517
    """
    return pp * virtual_stages * achieved_flops / (12 * hidden * layers * bandwidth) if pp > 1 else 0.0


def cp_bytes_per_layer(seq: int, micro_batch: int, hidden: int, heads: int, kv_heads: int, cp: int,
                       tp: int = 1, *, act_bytes: float = 2.0) -> float:
    """Bytes each context-parallel rank sends per layer per micro-batch with ring attention.

    Ring attention (Liu et al. 2023; torch's context_parallel): each rank's K and V shard, 2·(s/c)·b·kv·d
    elements (kv heads of head dim d = h/a, ÷ t under TP), passes c − 1 hops in forward; backward passes
    K, V again plus dK, dV: 3·(c−1) shards per layer in all.

    >>> cp_bytes_per_layer(8192, 1, 4096, 32, 8, 4, act_bytes=2) / 2**20   # 3·3·(2·2048·1024·2 B)
    72.0
    """
    if cp == 1:
        return 0.0
    kv_shard = 2 * (seq / cp) * micro_batch * kv_heads * (hidden // heads) * act_bytes / tp
    return 3 * (cp - 1) * kv_shard


def dp_bytes_per_step(params: float, zero_stage: int, shard: int, replicate: int, microbatches: int,
                      param_bytes: float = 2.0, grad_bytes: float = 2.0) -> tuple[float, float]:
    """Data-parallel bytes each GPU sends per step: ``(over the shard group, over the replicate group)``.

    ``params`` are the parameters on this GPU before data-parallel sharding (after TP and PP).
    DDP (stage 0): one all-reduce of the gradients over the replicas.
    ZeRO-1: reduce-scatter of the accumulated gradients once a step, all-gather of the updated weights.
    ZeRO-2: the gradient reduce-scatter runs every micro-batch (only a shard of the gradient is kept).
    ZeRO-3 / FSDP: all-gather of the weights in forward and again in backward, every micro-batch,
    plus the per-micro-batch reduce-scatter: 3·(N−1)/N·Ψ each, 1.5× DDP (Rajbhandari et al. 2020 §7).
    HSDP: the reduce-scattered shard is then all-reduced over the ``replicate`` group.

    >>> dp_bytes_per_step(1e9, 3, 8, 1, 1)   # 3 · 7/8 · 2 GB
    (5250000000.0, 0.0)
    """
    grads, weights = params * grad_bytes, params * param_bytes
    if zero_stage == 0:
        return 0.0, ring_allreduce_bytes(grads, replicate)
    scatters = microbatches if zero_stage >= 2 else 1
    gathers = 2 * microbatches if zero_stage == 3 else 1
    over_shard = scatters * ring_allgather_bytes(grads, shard) + gathers * ring_allgather_bytes(weights, shard)
    over_replicate = scatters * ring_allreduce_bytes(grads / shard, replicate)
    return over_shard, over_replicate


def ring_time(size_bytes: float, steps: int, bandwidth: float, latency: float) -> float:
    """Seconds for a collective: α-β (Hockney) model, ``steps``·α + bytes/W. A ring all-reduce over N ranks
    takes 2(N−1) steps, an all-gather or reduce-scatter N−1, a send one (NCCL's own tuning model,
    src/graph/tuning.cc: latency = steps × per-hop latency, ~3 µs per NVLink hop, ~5 µs per network hop
    for the Simple protocol).

    >>> ring_time(1e9, 14, 100e9, 5e-6)   # 10 ms + 70 µs
    0.01007
    """
    return steps * latency + size_bytes / bandwidth


def exposed_tp_time(tp_time: float, compute: float, overlap: float) -> float:
    """Seconds of TP communication left on the critical path: a share ``overlap`` of it hides behind the GEMMs
    (Megatron-LM's ``--tp-comm-overlap``, torch's async TP: the all-gather / reduce-scatter of one chunk runs while
    the previous chunk multiplies), but never more than the ``compute`` it hides behind.

    ``overlap`` is in [0, 1]; :func:`~meshkit.planner.plan` checks it once (this runs per layout).

    >>> exposed_tp_time(1.0, 10.0, 0.75), exposed_tp_time(1.0, 0.5, 1.0)
    (0.25, 0.5)
    """
    return tp_time - min(overlap * tp_time, compute)


def dp_overlap_tokens(achieved_flops: float, bandwidth: float) -> float:
    """Tokens each data-parallel rank must process per step for the gradient sync to hide behind compute.

    Compute is 6·Ψ FLOP per token per GPU, the ring all-reduce moves ~2·2Ψ bytes, so compute ≥ comm when
    tokens ≥ (2/3)·F/W; the rule of thumb (and this function) rounds it to F/W.

    >>> dp_overlap_tokens(400e12, 50e9)
    8000.0
    """
    return achieved_flops / bandwidth



DEFAULT_RIDGE = float(round(gpu("h100-sxm").ridge("bf16"), -2))


def roofline_efficiency(ridge: float, *dims: float) -> float:
    """Share of its large-shape rate a kernel sustains when its operands must stream through device memory.

    Soft roofline (Williams, Waterman & Patterson 2009, with compute and memory time added instead of
    overlapped): an (m×k)·(k×n) bf16 matmul does 2mkn FLOP and moves at least 2(mk + kn + mn) bytes
    (each operand read once, the result written once), so at peak P and memory bandwidth B it takes
    2mkn/P · (1 + (P/B)·(1/m + 1/k + 1/n)). Its efficiency is 1 / (1 + ridge · Σ 1/dim) with
    ridge = P/B the roofline's ridge point in FLOP/byte (295 on an H100 SXM: 989.4 TFLOP/s over 3.35 TB/s):
    a dimension as long as the ridge halves the rate, one 10× longer costs ~9%. Because the sum is
    symmetric, the backward matmuls (the same three dimensions, permuted) get the same efficiency. A fused
    attention kernel (FlashAttention) of m queries against n keys moves Q, K, V and O but never the m×n
    scores: 4mnd FLOP over 4d(m + n) bytes per head, so its dimensions are just (m, n).
    ``ridge=0`` turns the model off (efficiency 1).

    >>> round(roofline_efficiency(295, 4096, 4096, 4096), 3)   # 1 / (1 + 295 · 3/4096)
    0.822
    """
    if ridge <= 0:
        return 1.0
    return 1.0 / (1.0 + ridge * sum(1.0 / d for d in dims))


def matmul_efficiency(model: ModelSpec, tokens: float, tp: int, ridge: float) -> float:
    """Efficiency (:func:`roofline_efficiency`) of one GPU's matmuls, weighted by their FLOPs.

    ``tokens`` are the rows each GPU multiplies per micro-batch, b·s/cp (sequence parallelism all-gathers
    the TP group's rows before each matmul); tensor parallelism splits the other dimension t ways. Per
    block: wq (h × a·d/t), wk and wv (h × kv·d/t), wo (a·d/t × h), w1 and w3 (h × f/t), w2 (f/t × h);
    plus the output projection (h × V/t). The result is their FLOP-weighted harmonic mean (total FLOPs over
    total time), so a matmul that runs at half speed costs in proportion to its share of the work.

    >>> mdl = ModelSpec(layers=1, hidden=1024, heads=8, ffn=4096, vocab=1024)
    >>> round(matmul_efficiency(mdl, 2048, 1, 0), 3), round(matmul_efficiency(mdl, 2048, 1, 100), 3)
    (1.0, 0.839)
    """
    h, d, f = model.hidden, model.head_dim, model.ffn  # w3 only in a gated MLP
    q, kv = model.heads * d / tp, model.kv_heads * d / tp
    # (k, n, how many such matrices): per block, times layers; the output projection once
    block = ((h, q, 1), (h, kv, 2), (q, h, 1), (h, f / tp, model.mlp_matrices - 1), (f / tp, h, 1))
    shapes = [(k, n, c * model.layers) for k, n, c in block] + [(h, model.vocab / tp, 1)]
    flops = sum(k * n * c for k, n, c in shapes)
    time = sum(k * n * c / roofline_efficiency(ridge, tokens, k, n) for k, n, c in shapes)
    return flops / time


def attention_efficiency(seq: int, cp: int, ridge: float) -> float:
    """Efficiency (:func:`roofline_efficiency`) of the fused attention kernels of one context-parallel rank.

    Without CP one causal kernel pairs s queries with s keys: dimensions (s, s). Load-balanced causal ring
    attention (each rank holds two chunks of s/(2c), one from each end, so every rank does the same work)
    runs c kernels per layer: the local step pairs s/c queries with s/c keys, the c − 1 others s/c with
    s/(2c) (or s/(2c) with s/c: half of each arriving block is masked away). Every step does the same
    FLOPs (that is what the load balancing buys), so the penalty averages over the c steps:
    ((c − 1)·3c/s + 2c/s)/c = (3c − 1)/s, and efficiency = 1 / (1 + ridge·(3c − 1)/s). The halved blocks
    are the price of balancing the causal mask; c = 1 gives the plain kernel's 2/s.

    >>> round(attention_efficiency(8192, 1, 295), 3), round(attention_efficiency(8192, 8, 295), 3)
    (0.933, 0.547)
    """
    if ridge <= 0:
        return 1.0
    return 1.0 / (1.0 + ridge * (3 * cp - 1) / seq)



def elementwise_seconds(model: ModelSpec, tokens: float, tp: int, sp: bool, bytes_per_unit: float,
                        hbm_bw: float) -> float:
    """Seconds of the non-matmul work of ``tokens`` tokens through all ``model.layers`` blocks on one GPU of a TP
    group of ``tp``: memory-bound, ``bytes_per_unit`` × 2 bytes per unit of width per token per layer at ``hbm_bw``
    bytes/s. The width is h on the residual stream (norms, residual adds, dropout: whole on every TP rank without
    sequence parallelism, ÷ t with it) plus the MLP's activation width (f, or 2f gated, always ÷ t).

    >>> elementwise_seconds(ModelSpec(layers=1, hidden=1000, heads=10, ffn=4000, gated_mlp=False), 1000, 1, True,
    ...                     10, 1e12)   # 10 · 2 B · (1000 + 4000) · 1000 tokens / 1e12
    0.0001
    """
    mlp = model.ffn * (model.mlp_matrices - 1)
    width = model.hidden / (tp if sp else 1) + mlp / tp
    return bytes_per_unit * 2.0 * width * tokens * model.layers / hbm_bw


EAGER_SCORE_BYTES: tuple[float, float] = (13.0, 19.0)
"""Bytes of device-memory traffic per element of the s×s attention scores (per head, per sequence, per layer) of an
attention without FlashAttention, ``(forward, backward)``, counted on Megatron-LM's CoreAttention (bf16 scores,
1-byte dropout mask; Korthikanti et al. 2022 §4.1 count the same tensors, 5·a·s²·b bytes of them kept). Forward:
the QKᵀ baddbmm writes the scores (2), the fused scale-mask-softmax reads them and writes the probabilities (2 + 2),
dropout reads those and writes its output and its mask (2 + 2 + 1), the PV bmm reads the output (2): 13. Backward:
the PV bmm writes the probabilities' gradient and reads the probabilities for dV (2 + 2), dropout's backward reads
the gradient and the mask and writes its gradient (2 + 1 + 2), the softmax backward reads that gradient and the
probabilities and writes the scores' gradient (2 + 2 + 2), the QKᵀ backward reads it twice, for dQ and dK (2 + 2):
19. Counted, not fitted: FlashAttention (``flash=1``) keeps the scores on chip and moves none of it."""


def eager_score_seconds(model: ModelSpec, sequences: float, seq: int, cp: int, hbm_bw: float,
                        passes: tuple[float, ...] = EAGER_SCORE_BYTES) -> float:
    """Seconds the s×s attention scores of ``sequences`` sequences through all ``model.layers`` blocks take to stream
    through device memory at ``hbm_bw`` bytes/s, ``sum(passes)`` bytes per score element (:data:`EAGER_SCORE_BYTES`:
    forward + backward; a recomputed forward adds its 13). Under context parallelism each rank's s/c queries meet all
    s keys: a·s²/c elements per layer per sequence.

    >>> eager_score_seconds(ModelSpec(layers=1, hidden=64, heads=1), 1, 1000, 1, 32e9)   # 32 B · 1000² / 32e9
    0.001
    """
    return sum(passes) * model.layers * model.heads * float(seq) * seq / cp * sequences / hbm_bw


def effective_virtual_stages(v: int, pp: int, microbatches: int, penalty: float) -> float:
    """The bubble reduction an interleaved schedule of ``v`` chunks per rank delivers with m micro-batches:
    1 + (v − 1)/(1 + κ·p/m) (κ = ``penalty``; 0 gives v, the theory of Narayanan et al. 2021 §2.2.2).

    >>> effective_virtual_stages(4, 8, 16, 0.0), effective_virtual_stages(4, 8, 8, 1.0)
    (4.0, 2.5)
    """
    return 1.0 + (v - 1) / (1.0 + penalty * pp / microbatches)


def stage_imbalance(model: ModelSpec, seq: int, pp: int, split: str = "even") -> float:
    """The slowest pipeline stage's model FLOPs over the average stage's (1 without a pipeline): every stage runs at the
    pace of the slowest, so the others idle for the difference, each micro-batch.

    A stage holds :func:`~meshkit.planner.model.stage_layers` blocks; the last one also runs the output layer,
    6·h·V FLOP per token (the embedding lookup has none). A block's FLOPs are the profiler's count less the output
    layer's, over L (:meth:`ModelSpec.flops_per_token`). "even": ⌈L/p⌉ blocks everywhere, the output layer on top
    of the last stage's; "balanced": the end stages hold one block fewer (the output layer takes its slot).

    >>> mdl = ModelSpec(layers=4, hidden=64, heads=4, ffn=256, vocab=6400, gated_mlp=False)
    >>> stage_imbalance(mdl, 16, 1), round(stage_imbalance(mdl, 16, 4), 3)   # last stage: 1 block + the output layer
    (1.0, 2.998)
    """
    if pp == 1:
        return 1.0
    end, mid = stage_layers(model.layers, pp, split)
    vocab = 6.0 * model.vocab_params
    block = (model.flops_per_token(seq) - vocab) / model.layers
    slowest = max(mid * block, end * block + vocab)
    return slowest * pp / (model.layers * block + vocab)
