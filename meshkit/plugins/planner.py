"""Layout planner: choose dp_replicate / dp_shard / pp / cp / tp for a model and a cluster.

The planner does the arithmetic a careful engineer does by hand and shows it: for every layout
of the cluster it adds up the memory per GPU (model states per ZeRO stage, activations per
pipeline schedule), the communication each parallel axis costs on the link it runs over, the
pipeline bubble, how fast the per-GPU kernels run at the shapes the layout leaves them (a soft
roofline: smaller matmuls and attention chunks sustain less of the achieved FLOP/s), and predicts
a step time and MFU. Layouts that fit in memory (with a margin) are ranked by predicted step time;
each carries a one-line reason and the plan says why the best one wins. Pure Python: no process
group, no GPU.

Every formula is a small public function citing its source. Units: bytes, seconds, FLOP and
FLOP/s, bytes/s per direction; in the output "GB" is GiB (2**30 bytes, as torch.cuda reports
memory) and link speeds are decimal GB/s (1e9, as datasheets give them).

Mesh order is meshkit's default (``dp_replicate, dp_shard, pp, cp, tp``, outermost first), so
an axis stays inside a node when its degree times the degrees inside it fits in one node.

Example::

    >>> from meshkit.plugins.planner import ModelSpec, plan
    >>> model = ModelSpec(layers=32, hidden=4096, heads=32, ffn=11008, vocab=32000)
    >>> p = plan(model, seq_len=4096, global_batch=64, nodes=1, gpus_per_node=8,
    ...          gpu="h100-sxm", peak_tflops=989.4)
    >>> p.best.tp <= 4, p.best.feasible
    (True, True)
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from meshkit.hardware import CATALOG, Gpu, find_gpu, gpu
from meshkit.modelspec import read_shape
from meshkit.schedules import canonical_schedule, default_virtual_stages, theoretical_bubble

__all__ = [
    # inputs
    "ModelSpec",
    "GpuSpec",
    "GPU_TABLE",
    "gpu_spec",
    # formulas
    "model_state_bytes",
    "zero3_buffer_bytes",
    "activation_bytes_per_layer",
    "inflight_microbatches",
    "bubble_fraction",
    "ring_allreduce_bytes",
    "ring_allgather_bytes",
    "tp_bytes_per_layer",
    "pp_bytes_per_boundary",
    "tp_comm_ratio",
    "pp_comm_ratio",
    "cp_bytes_per_layer",
    "dp_bytes_per_step",
    "ring_time",
    "dp_overlap_tokens",
    "training_flops_per_token",
    "roofline_efficiency",
    "matmul_efficiency",
    "attention_efficiency",
    "DEFAULT_RIDGE",
    # results
    "Layout",
    "Plan",
    "plan",
    "plan_for_world",
    "auto_nd_dims",
    "CPU_NOMINAL_TFLOPS",
    "format_table",
    # CLI
    "configure_parser",
    "run_cli",
]

GiB = float(2**30)
SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b", "interleaved_1f1b", "interleaved_zero_bubble")
"""The schedules the planner models (:mod:`meshkit.schedules` names; interleaved_zero_bubble at one
stage per rank is ZB-H1). Aliases such as "interleaved" and "zero_bubble" are accepted."""
CHECKPOINTING: tuple[str, ...] = ("none", "selective", "full")


# ============================================================================ inputs: the model


@dataclass(frozen=True)
class ModelSpec:
    """The shape of a Llama-style decoder the planner needs (build one from a config with :meth:`from_config`).

    Example::

        >>> ModelSpec(layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672, vocab=128256).total_params / 1e9
        70.553706496
    """

    layers: int
    """Transformer blocks."""
    hidden: int
    """Hidden size h."""
    heads: int
    """Attention (query) heads a."""
    kv_heads: int | None = None
    """Key/value heads (GQA); None means ``heads``."""
    ffn: int | None = None
    """SwiGLU hidden size; None: inferred from ``params`` if given, else 4·h (GPT's MLP; 12·h² per layer)."""
    vocab: int = 32000
    """Vocabulary size."""
    params: float | None = None
    """Total parameters; when given, every count derived from the shape is scaled to it."""
    tied_embeddings: bool = False
    """Input embedding and output projection share one matrix."""

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "vocab"):
            _check_positive_int(f"ModelSpec: `{name}", getattr(self, name))
        for name in ("kv_heads", "ffn"):
            if getattr(self, name) is not None:
                _check_positive_int(f"ModelSpec: `{name}", getattr(self, name))
        if self.hidden % self.heads:
            raise ValueError(
                f"ModelSpec: `hidden={self.hidden}` must be divisible by `heads={self.heads}` (whole heads). "
                "Pass the model's real head count."
            )
        kv = self.kv_heads or self.heads
        if self.heads % kv:
            raise ValueError(f"ModelSpec: `heads={self.heads}` must be divisible by `kv_heads={kv}` (GQA groups).")
        object.__setattr__(self, "kv_heads", kv)
        if self.params is not None and not (self.params > 0):
            raise ValueError(f"ModelSpec: `params={self.params}` must be > 0 (a count of parameters, e.g. 7e9).")
        if self.ffn is None:
            ffn = 4 * self.hidden
            if self.params is not None:
                rest = self.params - self._embedding_params() - self.layers * self._attention_params()
                ffn = round(rest / (3 * self.hidden * self.layers))
                if ffn < 1:
                    raise ValueError(
                        f"ModelSpec: `params={self.params:.3g}` is smaller than the embeddings and attention of "
                        f"`layers={self.layers}`, `hidden={self.hidden}`, `vocab={self.vocab}` alone, "
                        "so no FFN size fits. "
                        "Check the shape or pass `ffn=`."
                    )
            object.__setattr__(self, "ffn", ffn)

    # ---- parameter counts (before the optional scaling to `params`) ----
    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def _attention_params(self) -> int:
        # wq (h × a·hd) + wk, wv (h × kv·hd each) + wo (a·hd × h) + two RMSNorm weights
        hd = self.head_dim
        return 2 * self.hidden * self.heads * hd + 2 * self.hidden * self.kv_heads * hd + 2 * self.hidden

    def _embedding_params(self) -> int:
        # tok_embeddings + output (unless tied) + final norm
        return self.vocab * self.hidden * (1 if self.tied_embeddings else 2) + self.hidden

    @property
    def _scale(self) -> float:
        raw = self.layers * (self._attention_params() + 3 * self.hidden * self.ffn) + self._embedding_params()
        return 1.0 if self.params is None else self.params / raw

    @property
    def layer_params(self) -> float:
        """Parameters of one transformer block: attention, SwiGLU (w1, w2, w3) and its two norms."""
        return (self._attention_params() + 3 * self.hidden * self.ffn) * self._scale

    @property
    def vocab_params(self) -> float:
        """Parameters of one vocabulary matrix (the embedding, or the output projection)."""
        return self.vocab * self.hidden * self._scale

    @property
    def total_params(self) -> float:
        return self.layers * self.layer_params + self._embedding_params() * self._scale

    @property
    def matmul_params(self) -> float:
        """Parameters used in matmuls: all but the input embedding lookup (the output projection counts)."""
        return self.layers * self.layer_params + self.vocab_params

    @classmethod
    def from_config(cls, config: Any, params: float | None = None) -> "ModelSpec":
        """From anything :func:`meshkit.modelspec.read_shape` reads (a meshkit ``LlamaConfig``, a Hugging Face
        config, torchtitan-style args, a module with ``.config`` or containing one, e.g. a LightningModule
        around an HF model), or a ``ModelSpec`` (returned as is).

        Example::

            >>> from meshkit.models import LlamaConfig
            >>> ModelSpec.from_config(LlamaConfig.tiny()).kv_heads
            2
        """
        if isinstance(config, ModelSpec):
            return config
        try:
            shape = read_shape(config)
        except ValueError as exc:
            raise ValueError(
                f"ModelSpec.from_config: `config={type(config).__name__}` has neither meshkit LlamaConfig fields "
                "(n_layers, dim, n_heads) nor Hugging Face ones (num_hidden_layers, hidden_size, num_attention_heads). "
                "Pass a ModelSpec(layers=..., hidden=..., heads=...) instead."
            ) from exc
        return cls(layers=shape.layers, hidden=shape.hidden, heads=shape.heads, kv_heads=shape.kv_heads,
                   ffn=shape.ffn, vocab=shape.vocab, params=params, tied_embeddings=shape.tied_embeddings)


def _check_positive_int(name: str, value: Any) -> None:
    """``name`` is "Owner: `field" (the backquote is closed here)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r}` must be a positive int.")


# ============================================================================ inputs: the GPU


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


# ============================================================================ formulas


def model_state_bytes(params: float, zero_stage: int, shard: int, optimizer_bytes: float = 16.0,
                      param_bytes: float = 2.0, grad_bytes: float = 2.0) -> float:
    """Bytes of parameters, gradients and optimizer state per GPU for ``params`` parameters on it.

    ZeRO (Rajbhandari et al. 2020, §5, Fig. 1): with K = optimizer_bytes − param_bytes − grad_bytes
    (AdamW mixed precision: 16 = 2 bf16 weights + 2 bf16 grads + 12 fp32 master, m, v) and N = ``shard``:
    stage 0 (DDP) (2+2+K)Ψ; stage 1 (2+2)Ψ + KΨ/N; stage 2 2Ψ + (2+K)Ψ/N; stage 3 (2+2+K)Ψ/N.

    >>> model_state_bytes(7.5e9, 1, 64) / 1e9   # the paper's Fig. 1 example: 31.4 GB
    31.40625
    """
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"model_state_bytes: `zero_stage={zero_stage}` must be 0, 1, 2 or 3.")
    k = optimizer_bytes - param_bytes - grad_bytes
    if zero_stage == 0:
        return params * (param_bytes + grad_bytes + k)
    if zero_stage == 1:
        return params * (param_bytes + grad_bytes + k / shard)
    if zero_stage == 2:
        return params * (param_bytes + (grad_bytes + k) / shard)
    return params * (param_bytes + grad_bytes + k) / shard


def zero3_buffer_bytes(layer_params: float, param_bytes: float = 2.0, grad_bytes: float = 2.0) -> float:
    """Working memory ZeRO-3 / FSDP adds: two layers' gathered weights (current + prefetched) and one
    layer's unsharded gradient before its reduce-scatter (Rajbhandari et al. 2020 §5.3; FSDP2 prefetches
    one block ahead). ``layer_params`` is one block's parameters on this GPU (after TP)."""
    return layer_params * (2 * param_bytes + grad_bytes)


def activation_bytes_per_layer(seq: int, micro_batch: int, hidden: int, heads: int, tp: int = 1, *,
                               sequence_parallel: bool = False, attention_scores: bool = True,
                               checkpointing: str = "none", ffn: int | None = None) -> float:
    """Activation bytes one transformer layer keeps for backward, for one micro-batch (16-bit activations).

    Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models":
    eq. (2)/(3) with tensor parallelism  s·b·h·(10 + 24/t + 5·a·s/(h·t));
    eq. (4) with sequence parallelism   s·b·h/t·(34 + 5·a·s/h);
    selective recomputation (§5) drops the 5·a·s/h attention-score term, as FlashAttention does
    (``attention_scores=False``: it never stores the s×s scores); full recomputation keeps only the
    layer input, 2·s·b·h (÷ t with sequence parallelism).
    The paper's 24/t is 8 (attention) + 16 (a 4h GELU MLP's two 4h outputs); a SwiGLU MLP of width
    ``ffn`` = f stores three f-wide outputs (w1, w3, their product), so with ``ffn`` given 24 becomes
    8 + 6·f/h (the same 24 at Llama's f = 8h/3; 27.5 at Llama-3-405B's f = 3.25h).

    >>> activation_bytes_per_layer(2048, 1, 12288, 96, 8) / 2**20   # GPT-3 175B, t=8: 23·s·b·h
    552.0
    """
    if checkpointing not in CHECKPOINTING:
        raise ValueError(
            f"activation_bytes_per_layer: `checkpointing={checkpointing!r}` must be one of {CHECKPOINTING}.")
    sbh = float(seq) * micro_batch * hidden
    sharded = 24.0 if ffn is None else 8.0 + 6.0 * ffn / hidden
    if checkpointing == "full":
        return 2 * sbh / (tp if sequence_parallel else 1)
    scores = 5 * heads * seq / (hidden * tp) if attention_scores and checkpointing == "none" else 0.0
    if sequence_parallel:
        return sbh * ((10 + sharded) / tp + scores)
    return sbh * (10 + sharded / tp + scores)


def inflight_microbatches(schedule: str, pp: int, microbatches: int, virtual_stages: int = 2) -> float:
    """Micro-batches whose activations the busiest (first) stage holds at once, in units of one stage's layers.

    GPipe (Huang et al. 2019): all m. 1F1B (Narayanan et al. 2021 §2.2): p − s on stage s, so p on the first.
    Interleaved 1F1B with v chunks per stage: p·(1 + (p−1)/(p·v)) (Korthikanti et al. 2022 §4.2.3).
    Zero bubble ZB-H1 (Qi et al. 2023 §3): the same peak as 1F1B. No pipeline: one micro-batch.

    >>> inflight_microbatches("1f1b", 4, 16), inflight_microbatches("interleaved", 4, 16, 2)
    (4, 5.5)
    """
    if pp == 1 or schedule == "none":
        return 1
    name = canonical_schedule(schedule)
    if name == "gpipe":
        return microbatches
    if name in ("1f1b", "interleaved_zero_bubble"):
        return min(pp, microbatches)
    if name == "interleaved_1f1b":
        return pp * (1 + (pp - 1) / (pp * virtual_stages))
    raise ValueError(f"inflight_microbatches: `schedule={schedule!r}` has no activation model; use one of {SCHEDULES}.")


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


def tp_bytes_per_layer(seq: int, micro_batch: int, hidden: int, tp: int, *, act_bytes: float = 2.0,
                       recompute: bool = False) -> float:
    """Bytes each TP rank sends per transformer layer per micro-batch.

    Megatron-LM (Shoeybi et al. 2019 §3, Fig. 4): two all-reduces of the s·b·h activation in forward
    (after attention and after the MLP) and two in backward; sequence parallelism (Korthikanti et al. 2022
    §4.2.2) swaps each for an all-gather + reduce-scatter, the same bytes. Full recomputation repeats
    the forward's two. Each: ring_allreduce_bytes(s·b·h·act_bytes, t). Over a step of 12h²-parameter
    blocks that is a comm/compute ratio of 2(t−1)·F/(9·h·W); :func:`tp_comm_ratio` publishes the forward
    pass's (t−1)·F/(3·h·W), 1.5× that.

    >>> tp_bytes_per_layer(1024, 1, 4096, 8) / 2**20   # 4 · 2·7/8 · 8 MiB
    56.0
    """
    collectives = 6 if recompute else 4
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


def dp_overlap_tokens(achieved_flops: float, bandwidth: float) -> float:
    """Tokens each data-parallel rank must process per step for the gradient sync to hide behind compute.

    Compute is 6·Ψ FLOP per token per GPU, the ring all-reduce moves ~2·2Ψ bytes, so compute ≥ comm when
    tokens ≥ (2/3)·F/W; the rule of thumb (and this function) rounds it to F/W.

    >>> dp_overlap_tokens(400e12, 50e9)
    8000.0
    """
    return achieved_flops / bandwidth


def training_flops_per_token(matmul_params: float, layers: int, hidden: int, seq: int) -> float:
    """Model FLOPs per token for forward + backward: 6·N + 12·L·h·s (PaLM, Chowdhery et al. 2022, app. B;
    N the matmul parameters, the 12·L·h·s term the attention scores and their weighted sum; no recompute).

    >>> training_flops_per_token(1e9, 10, 1000, 100)
    6012000000.0
    """
    return 6 * matmul_params + 12 * layers * hidden * seq


# Roofline ridge (FLOP/byte) for a device outside GPU_TABLE: the H100 SXM's 295 (989.4 TFLOP/s over
# 3.35 TB/s) rounded to 300; recent accelerators sit between ~150 (A100, MI250X) and ~400 (L4, L40S).
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
    h, d, f = model.hidden, model.head_dim, model.ffn
    q, kv = model.heads * d / tp, model.kv_heads * d / tp
    # (k, n, how many such matrices): per block, times layers; the output projection once
    block = ((h, q, 1), (h, kv, 2), (q, h, 1), (h, f / tp, 2), (f / tp, h, 1))
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


# ============================================================================ layouts


LOSSES: tuple[str, ...] = ("bubble", "tp", "pp", "cp", "dp", "recompute", "kernels")


@dataclass
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

    def describe(self) -> str:
        """Short spelling, e.g. ``dp_shard=128 pp=16 tp=8 zero1 interleaved_1f1b(v=4) m=16 ac=full``."""
        axes = ("dp_replicate", "dp_shard", "pp", "cp", "tp")
        parts = [f"{a}={getattr(self, a)}" for a in axes if getattr(self, a) > 1]
        parts.append(f"zero{self.zero_stage}")
        if self.pp > 1:
            parts.append(self.schedule + (f"(v={self.virtual_stages})" if self.virtual_stages > 1 else ""))
        parts.append(f"m={self.microbatches}")
        if self.activation_checkpointing != "none":
            parts.append(f"ac={self.activation_checkpointing}")
        return " ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        """The JSON record (``meshkit plan --json``)."""
        keys = ("dp_replicate", "dp_shard", "pp", "cp", "tp", "zero_stage", "schedule", "microbatches",
                "virtual_stages", "activation_checkpointing", "model_state_gb", "activation_gb", "memory_gb",
                "memory_limit_gb", "bubble_fraction", "tp_comm_ratio", "pp_comm_ratio", "cp_comm_ratio",
                "dp_comm_ratio", "dp_overlap_ok", "tp_intra_node", "matmul_efficiency", "attention_efficiency",
                "compute_s", "step_time_s", "predicted_mfu", "feasible", "reason")
        out = {k: getattr(self, k) for k in keys}
        return {k: round(v, 6) if isinstance(v, float) else v for k, v in out.items()}

    def to_parallel_dims(self) -> Any:
        """The :class:`~meshkit.plugins.dims.ParallelDims` of this layout."""
        from meshkit.plugins.dims import ParallelDims

        return ParallelDims(dp_replicate=self.dp_replicate, dp_shard=self.dp_shard, pp=self.pp, cp=self.cp,
                            tp=self.tp, world_size=self.world_size)


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
    optimizer_bytes: float
    zero_stages: tuple[int, ...]
    schedules: tuple[str, ...]
    checkpointing: tuple[str, ...]
    virtual_stages: tuple[int, ...]
    flash: bool
    sp: bool
    max_pp: int
    max_cp: int
    max_tp: int
    # derived once in __post_init__
    model_flops: float = 0.0
    _times: dict[tuple[int, int], "_Compute"] = field(default_factory=dict)

    def __post_init__(self) -> None:
        mdl = self.model
        self.layer_params, self.vocab_params = mdl.layer_params, mdl.vocab_params
        self.model_flops = self.batch * self.seq * training_flops_per_token(mdl.matmul_params, mdl.layers,
                                                                            mdl.hidden, self.seq)

    def times(self, cp: int, tp: int) -> "_Compute":
        """Compute seconds per GPU per step for a cp × tp split (cached: many layouts share one)."""
        key = (cp, tp)
        if key not in self._times:
            self._times[key] = _Compute.of(self, cp, tp)
        return self._times[key]

    def link(self, inner: int) -> tuple[float, float]:
        """(bandwidth, latency) of an axis whose groups span ``inner`` consecutive ranks (degree × inner degrees)."""
        return self.intra if inner <= self.gpn and self.gpn % inner == 0 else self.inter


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
        at_eff = attention_efficiency(s, cp, ctx.ridge)
        per_gpu = ctx.batch * s / ctx.world / ctx.achieved  # seconds per (FLOP per token) at full efficiency
        attn = mdl.layers * mdl.hidden * s  # the PaLM attention term per token is 12 of these
        # Recompute per token: selective re-runs the attention core's forward (4·L·h·s), full the whole
        # forward (2N + 4·L·h·s): Korthikanti et al. 2022 §5.
        extra = {"none": (0.0, 0.0), "selective": (0.0, 4.0 * attn), "full": (2.0 * mdl.matmul_params, 4.0 * attn)}
        model = (6.0 * mdl.matmul_params / mm_eff + 12.0 * attn / at_eff) * per_gpu
        ideal = (6.0 * mdl.matmul_params + 12.0 * attn) * per_gpu
        recompute = {ac: (mm / mm_eff + at / at_eff) * per_gpu for ac, (mm, at) in extra.items()}
        # attention forward of one layer, one micro-batch, on one GPU: 4·h·s FLOP per token (PaLM's 12·h·s ÷ 3)
        attention_fwd = 4.0 * mdl.hidden * s * (ctx.micro * s / cp) / tp / (ctx.achieved * at_eff)
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


def _enumerate(ctx: _Ctx) -> tuple[list[Layout], dict[str, int]]:
    layouts: list[Layout] = []
    rejected: dict[str, int] = {}
    w = ctx.world
    for r in _divisors(w):
        for d in _divisors(w // r):
            for p in _divisors(w // (r * d)):
                for c in _divisors(w // (r * d * p)):
                    t = w // (r * d * p * c)
                    rule = _structural_rule(ctx, r, d, p, c, t)
                    if rule is None:
                        layouts.extend(_layouts_for(ctx, r, d, p, c, t))
                    else:
                        rejected[rule] = rejected.get(rule, 0) + 1
    return layouts, rejected


def _layouts_for(ctx: _Ctx, r: int, d: int, p: int, c: int, t: int) -> list[Layout]:
    """Every (zero stage, schedule, checkpointing) variant of one set of degrees, fully evaluated."""
    mdl, b = ctx.model, ctx.micro
    m = ctx.batch // (b * r * d)
    shard, s_local, layers_stage = d * c, ctx.seq // c, math.ceil(mdl.layers / p)

    # ---- memory pieces (the busiest stage: the first stage's in-flight activations, plus the vocab matrices) ----
    vocab_mats = (1 if mdl.tied_embeddings else 2) if p == 1 else 1
    params_gpu = (layers_stage * ctx.layer_params + vocab_mats * ctx.vocab_params) / t
    sp = ctx.sp and t > 1
    per_layer = {ac: activation_bytes_per_layer(s_local, b, mdl.hidden, mdl.heads, t, sequence_parallel=sp,
                                                attention_scores=not ctx.flash, checkpointing=ac, ffn=mdl.ffn)
                 for ac in ctx.checkpointing}
    working = dict.fromkeys(ctx.checkpointing, 0.0)
    if "full" in working:  # the layer being recomputed holds its full activations once
        working["full"] = activation_bytes_per_layer(s_local, b, mdl.hidden, mdl.heads, t, sequence_parallel=sp,
                                                     attention_scores=not ctx.flash, ffn=mdl.ffn)
    logits = 8.0 * s_local * b * mdl.vocab / t  # fp32 logits and their gradient for the micro-batch in the loss

    # ---- communication that does not depend on the variant ----
    # TP: 4 (6 with full recompute) ring collectives of 2(t−1) steps per layer per micro-batch, not overlapped.
    tp_link = ctx.link(t)
    tp_time = {ac: ring_time(tp_bytes_per_layer(s_local, b, mdl.hidden, t, recompute=ac == "full") * layers_stage * m,
                             (6 if ac == "full" else 4) * layers_stage * m * 2 * (t - 1), *tp_link)
               for ac in ctx.checkpointing}
    times = ctx.times(c, t)
    # CP: ring hops hide behind the attention they feed, one step at a time: in forward each of the c − 1 hops
    # (one K,V shard) overlaps one of the c attention steps; in backward each hop carries K, V, dK, dV (twice
    # the bytes) behind a step of the backward (twice the FLOPs). A short chunk exposes the rest of its hop.
    cp_link = ctx.link(c * t)
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
    # the issue's forward-pass ratios, at the rate this layout's matmuls run
    rate = ctx.achieved * times.matmul_eff
    tp_ratio = tp_comm_ratio(t, mdl.hidden, rate, tp_link[0])
    shard_link, rep_link = ctx.link(d * p * c * t), ctx.link(ctx.world)
    dp_bw = shard_link[0] if shard > 1 else rep_link[0]
    overlap_ok = r * d == 1 or ctx.batch * ctx.seq / (r * d) >= dp_overlap_tokens(ctx.achieved, dp_bw)

    runs: list[tuple[str, int]] = [("none", 1)]
    if p > 1:  # interleaved needs v·p chunks of ≥ 1 layer and m a multiple of p (Megatron-LM's rule)
        runs = [(s, 1) for s in ctx.schedules if s != "interleaved_1f1b"] + [
            ("interleaved_1f1b", v) for v in ctx.virtual_stages
            if "interleaved_1f1b" in ctx.schedules and mdl.layers >= p * v and m % p == 0]
    zeros = (0,) if shard == 1 else tuple(z for z in ctx.zero_stages if z > 0)

    out: list[Layout] = []
    for z in zeros:
        states = model_state_bytes(params_gpu, z, shard, ctx.optimizer_bytes)
        if z == 3:
            states += zero3_buffer_bytes(ctx.layer_params / t)
        # DP: per-block collectives (FSDP / ZeRO buckets ~ one per layer) over the shard group, then the replicas.
        over_shard, over_rep = dp_bytes_per_step(params_gpu, z, shard, r, m)
        scatters = m if z >= 2 else 1
        gathers = 2 * m if z == 3 else (1 if z else 0)
        dp_time = (ring_time(over_shard, layers_stage * (scatters + gathers) * (shard - 1), *shard_link)
                   + ring_time(over_rep, layers_stage * (scatters if z else 1) * 2 * (r - 1), *rep_link))
        for sched, v in runs:
            inflight = inflight_microbatches(sched, p, m, v)
            bubble = bubble_fraction(sched, p, m, v)
            # one send forward and one backward per micro-batch per chunk boundary (v per rank when interleaved)
            pp_time = ring_time(pp_bytes_per_boundary(s_local, b, mdl.hidden, t) * m * v, 2 * m * v, *pp_link) \
                if p > 1 else 0.0
            pp_ratio = pp_comm_ratio(p, mdl.hidden, mdl.layers, rate, pp_link[0], v)
            for ac in ctx.checkpointing:
                acts = per_layer[ac] * layers_stage * inflight + working[ac] + logits
                memory = states + acts
                compute = times.compute[ac]
                bubble_time = compute * bubble / (1 - bubble)
                # ZeRO-3 prefetches forward all-gathers behind forward compute; the rest hides behind backward (2/3).
                dp_exposed = max(0.0, dp_time - compute * (1.0 if z == 3 else 2.0 / 3.0))
                step = compute + bubble_time + tp_time[ac] + pp_time + cp_exposed + dp_exposed
                out.append(Layout(
                    r, d, p, c, t, z, sched, m, ac, v,
                    model_state_gb=states / GiB, activation_gb=acts / GiB, memory_gb=memory / GiB,
                    memory_limit_gb=ctx.memory / GiB, bubble_fraction=bubble, tp_comm_ratio=tp_ratio,
                    pp_comm_ratio=pp_ratio, cp_comm_ratio=cp_time / compute, dp_comm_ratio=dp_time / compute,
                    dp_overlap_ok=overlap_ok, tp_intra_node=tp_link is ctx.intra, matmul_efficiency=times.matmul_eff,
                    attention_efficiency=times.attention_eff, compute_s=compute, step_time_s=step,
                    predicted_mfu=ctx.model_flops / (ctx.world * ctx.peak * step), feasible=memory <= ctx.memory,
                    losses=(bubble_time, tp_time[ac], pp_time, cp_exposed, dp_exposed, times.recompute[ac],
                            times.kernels),
                ))
    return out


def _loss_phrase(lay: Layout, key: str) -> str:
    if key == "bubble":
        return f"pipeline bubble {lay.bubble_fraction:.0%} ({lay.schedule}, pp={lay.pp}, m={lay.microbatches})"
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


# ============================================================================ the plan


@dataclass
class Plan:
    """Every layout the planner considered, ranked best first (feasible ones first), and why."""

    layouts: list[Layout]
    rejected: dict[str, int]
    """Structural rules and how many degree combinations each ruled out."""
    inputs: dict[str, Any]

    @property
    def feasible(self) -> list[Layout]:
        return [lay for lay in self.layouts if lay.feasible]

    @property
    def best(self) -> Layout | None:
        """The fastest feasible layout, or None (then :attr:`explanation` says why)."""
        return self.layouts[0] if self.layouts and self.layouts[0].feasible else None

    @property
    def explanation(self) -> str:
        """Why the best layout wins, or why nothing fits."""
        best = self.best
        if best is None:
            return self._why_infeasible()
        text = (f"best: {best.describe()}: {best.step_time_s:.3g} s/step, predicted MFU {best.predicted_mfu:.1%}, "
                f"{best.memory_gb:.1f}/{best.memory_limit_gb:.1f} GB ({best.reason.split(';')[0]})")
        shape = (best.pp, best.cp, best.tp)
        # The runner-up is the best layout with other pp/cp/tp degrees; variants that only split dp
        # differently (dp_replicate vs dp_shard) or change the ZeRO stage are near-ties, counted.
        ties = sum(1 for lay in self.feasible[1:] if (lay.pp, lay.cp, lay.tp) == shape
                   and lay.step_time_s <= best.step_time_s * 1.01)
        if ties:
            text += f"; {ties} variant(s) with the same pp/cp/tp (other dp split or ZeRO stage) are within 1%"
        runner = next((lay for lay in self.feasible if (lay.pp, lay.cp, lay.tp) != shape), None)
        if runner is None:
            return text + "; no layout with other pp/cp/tp degrees fits."
        gaps = [rl - bl for rl, bl in zip(runner.losses, best.losses)]
        key = LOSSES[gaps.index(max(gaps))]
        why = f"it loses most to {_loss_phrase(runner, key)}" if max(gaps) > 0 else "the difference is in rounding"
        text += (f"; {runner.step_time_s / best.step_time_s:.2f}× faster than the best other shape, "
                 f"{runner.describe()} ({runner.step_time_s:.3g} s/step): {why}.")
        close = len({(lay.pp, lay.cp, lay.tp) for lay in self.feasible
                     if lay.step_time_s <= best.step_time_s * 1.03} - {shape})
        if close:
            text += (f" {close} other pp/cp/tp shape(s) come within 3%, inside this model's error: "
                     "any of them is a sound choice.")
        return text

    def _why_infeasible(self) -> str:
        inp = self.inputs
        if not self.layouts:
            rules = "; ".join(f"{rule} ({n} combinations)" for rule, n in self.rejected.items())
            return f"No layout of {inp['world_size']} GPUs is possible: {rules}."
        smallest = min(self.layouts, key=lambda lay: lay.memory_gb)
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
        tp_rule = next((rule for rule in self.rejected if rule.startswith("tp must divide")), None)
        if tp_rule and smallest.tp == 1:
            text += f" TP cannot help: {tp_rule}."
        return text

    def to_dict(self, top: int | None = None) -> dict[str, Any]:
        best = self.best
        return {"layouts": [lay.to_dict() for lay in self.layouts[:top]],
                "best": best.to_dict() if best else None, "explanation": self.explanation,
                "rejected": dict(self.rejected), "inputs": self.inputs}

    def table(self, top: int | None = 10) -> str:
        return format_table(self.layouts[:top])


def format_table(layouts: Sequence[Layout]) -> str:
    """A fixed-width table of layouts, one per line, for logs and the CLI.

    Example::

        >>> from meshkit.plugins.planner import Layout
        >>> table = format_table([Layout(1, 8, 1, 1, 1, 3, "none", 8, "none", feasible=True)])
        >>> table.splitlines()[0].split()[:6], len(table.splitlines())
        (['#', 'rep', 'shard', 'pp', 'cp', 'tp'], 2)
    """
    head = (f"{'#':<3} {'rep':>3} {'shard':>5} {'pp':>3} {'cp':>3} {'tp':>3} {'zero':>4} {'sched':<23} {'m':>3}   "
            f"{'ac':<9} {'mem GB':>7} {'act GB':>7} {'bubble':>7} {'tp/comp':>8} {'mm eff':>6} {'step s':>7} "
            f"{'MFU':>5}  fits  reason")
    lines = [head]
    for i, lay in enumerate(layouts, 1):
        lines.append(
            f"{i:<3} {lay.dp_replicate:>3} {lay.dp_shard:>5} {lay.pp:>3} {lay.cp:>3} {lay.tp:>3} {lay.zero_stage:>4} "
            f"{lay.schedule:<23} {lay.microbatches:>3}   {lay.activation_checkpointing:<9} {lay.memory_gb:>7.1f} "
            f"{lay.activation_gb:>7.1f} {lay.bubble_fraction:>7.1%} {lay.tp_comm_ratio:>8.3f} "
            f"{lay.matmul_efficiency:>6.0%} {lay.step_time_s:>7.3g} {lay.predicted_mfu:>5.1%}  "
            f"{'yes' if lay.feasible else 'no ':<4}  {lay.reason}"
        )
    return "\n".join(lines)


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
         achieved_tflops: float | None = None, achieved_fraction: float = 0.5, memory_margin: float = 0.10,
         optimizer_bytes: float = 16.0, zero_stage: int | Sequence[int] | None = None,
         activation_checkpointing: str | Sequence[str] = "auto", schedule: str | Sequence[str] = "auto",
         virtual_stages: Sequence[int] = (2, 4, 8), flash_attention: bool = True, sequence_parallel: bool = True,
         dtype: str = "bf16", max_pp: int | None = None, max_cp: int | None = None,
         max_tp: int | None = None, roofline_ridge: float | None = None) -> Plan:
    """Enumerate every layout of ``nodes × gpus_per_node`` GPUs for ``model`` and rank them.

    ``model`` is a :class:`ModelSpec`, a meshkit ``LlamaConfig``, a Hugging Face config or a model with
    ``.config``. ``gpu`` is a :data:`GPU_TABLE` name or device string; another device needs ``memory_gb``
    (its links then default to 450 / 50 GB/s). Bandwidths are per GPU per direction (defaults from the
    table: 450 GB/s NVLink, 50 GB/s InfiniBand on H100); ``peak_tflops`` defaults to profiling's dense
    peak for ``gpu`` and ``dtype``; achieved FLOP/s to ``achieved_fraction`` of it: the rate large matmuls
    sustain. A layout's kernels run at that rate times their shape efficiency (:func:`matmul_efficiency`,
    :func:`attention_efficiency`), set by ``roofline_ridge`` (FLOP/byte; default the dense peak over the GPU's
    memory bandwidth, 295 on an H100 SXM, :data:`DEFAULT_RIDGE` for a device outside the table; 0 turns
    the shape model off). ``zero_stage``, ``schedule`` and
    ``activation_checkpointing`` fix a choice or (None / "auto") let the planner try each.
    ``flash_attention`` drops the s×s score term from the activations (FlashAttention / SDPA never
    stores it); ``sequence_parallel`` shards TP activations as torchtitan's TP plan does.
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
    if not 0 < achieved_fraction <= 1:
        raise ValueError(f"plan: `achieved_fraction={achieved_fraction}` must be in (0, 1], e.g. 0.5.")
    try:
        spec: GpuSpec | None = gpu_spec(gpu)
    except ValueError:
        if memory_gb is None:  # a device outside the table needs its memory; links default to 450 / 50 GB/s
            raise
        spec = None
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
    if roofline_ridge is None:
        roofline_ridge = peak / (spec.hbm_bw_gbs * 1e9) if spec is not None else DEFAULT_RIDGE
    if not roofline_ridge >= 0:
        raise ValueError(f"plan: `roofline_ridge={roofline_ridge}` must be >= 0 FLOP/byte (0: no kernel-shape model).")
    auto_ac = ("none", "full") if flash_attention else CHECKPOINTING
    world = nodes * gpus_per_node
    ctx = _Ctx(
        model=mdl, seq=seq_len, batch=global_batch, micro=micro_batch, gpn=gpus_per_node, world=world,
        memory=mem * GiB * (1 - memory_margin), intra=(intra * 1e9, intra_latency_us * 1e-6),
        inter=(inter * 1e9, inter_latency_us * 1e-6), peak=peak, achieved=achieved, ridge=float(roofline_ridge),
        optimizer_bytes=optimizer_bytes,
        zero_stages=_as_tuple(zero_stage, (0, 1, 2, 3), "zero_stage", (1, 2, 3)),
        schedules=_as_tuple(_canonical_schedules(schedule), SCHEDULES, "schedule", SCHEDULES),
        checkpointing=_as_tuple(activation_checkpointing, CHECKPOINTING, "activation_checkpointing", auto_ac),
        virtual_stages=tuple(virtual_stages), flash=flash_attention, sp=sequence_parallel,
        max_pp=max_pp or world, max_cp=max_cp or world, max_tp=max_tp or world,
    )
    layouts, rejected = _enumerate(ctx)
    layouts.sort(key=_rank_key)
    inputs = {"params": mdl.total_params, "layers": mdl.layers, "hidden": mdl.hidden, "heads": mdl.heads,
              "kv_heads": mdl.kv_heads, "ffn": mdl.ffn, "vocab": mdl.vocab, "seq_len": seq_len,
              "global_batch": global_batch, "micro_batch": micro_batch, "nodes": nodes,
              "gpus_per_node": gpus_per_node, "world_size": world, "gpu": spec.name if spec else gpu,
              "memory_gb": mem, "memory_margin": memory_margin, "intra_bw_gbs": intra, "inter_bw_gbs": inter,
              "peak_tflops": peak / 1e12, "achieved_tflops": achieved / 1e12, "roofline_ridge": roofline_ridge,
              "optimizer_bytes": optimizer_bytes}
    return Plan(layouts, rejected, inputs)


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
        >>> lay.to_parallel_dims().world_size, lay.pp, lay.cp
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


def auto_nd_dims(model: Any, world_size: int, num_nodes: int, device: str, *, seq_len: int | None = None,
                 global_batch: int | None = None, micro_batch: int = 1, memory_gb: float | None = None,
                 reshard_after_forward: bool = True, sequence_parallel: bool = False,
                 activation_checkpointing: str = "none", log: Callable[[str], Any] | None = None,
                 **kwargs: Any) -> Any:
    """The :class:`~meshkit.plugins.dims.ParallelDims` ``strategy="auto_nd"`` trains with.

    Thin glue over :func:`plan_for_world` for the strategy's ``setup_environment``: the planner sees the
    strategy's own settings (FSDP2's ``reshard_after_forward`` = ZeRO-3, else ZeRO-2; sequence
    parallelism; activation checkpointing), ``seq_len`` defaults to the model config's ``max_seq_len``
    (``max_position_embeddings`` for HF), and ``global_batch`` to one ``micro_batch`` per rank (Lightning's
    per-rank batch; ranking by step time at a fixed global batch is ranking by tokens per second).

    Example::

        >>> from meshkit.models import LlamaConfig
        >>> auto_nd_dims(LlamaConfig.tiny(), world_size=4, num_nodes=1, device="cpu", seq_len=64).world_size
        4
    """
    if seq_len is None:
        try:
            seq_len = read_shape(model).max_seq_len
        except ValueError:
            seq_len = None
        if seq_len is None:
            raise ValueError(
                "auto_nd_dims: the model's config has no `max_seq_len` / `max_position_embeddings`; "
                "pass `seq_len=` (tokens per sequence in training)."
            )
    if num_nodes < 1 or world_size % num_nodes:
        raise ValueError(
            f"auto_nd_dims: `world_size={world_size}` must be a multiple of `num_nodes={num_nodes}` "
            "(every node runs the same number of ranks)."
        )
    zero = (0, 3) if reshard_after_forward else (0, 2)
    layout = plan_for_world(model, world_size, world_size // num_nodes, device, seq_len,
                            global_batch or world_size * micro_batch, micro_batch, memory_gb=memory_gb,
                            zero_stage=zero, sequence_parallel=sequence_parallel,
                            activation_checkpointing=activation_checkpointing, log=log, **kwargs)
    return layout.to_parallel_dims()


# ============================================================================ CLI


def configure_parser(parser: argparse.ArgumentParser) -> None:
    """Flags of ``meshkit plan``."""
    g = parser.add_argument_group("model")
    g.add_argument("--params", type=float, default=None, help="total parameters, e.g. 70e9 (scales the shape's counts)")
    g.add_argument("--layers", type=int, required=True)
    g.add_argument("--hidden", type=int, required=True)
    g.add_argument("--heads", type=int, required=True)
    g.add_argument("--kv-heads", type=int, default=None)
    g.add_argument("--ffn", type=int, default=None, help="SwiGLU hidden size (default: from --params, else 4·hidden)")
    g.add_argument("--vocab", type=int, default=32000)
    g = parser.add_argument_group("batch")
    g.add_argument("--seq-len", type=int, required=True)
    g.add_argument("--global-batch", type=int, required=True, help="sequences per optimizer step")
    g.add_argument("--micro-batch", type=int, default=1)
    g = parser.add_argument_group("cluster")
    g.add_argument("--nodes", type=int, default=1)
    g.add_argument("--gpus-per-node", type=int, default=8)
    g.add_argument("--gpu", default="h100-sxm", help=f"one of {', '.join(GPU_TABLE)} or a device string")
    g.add_argument("--memory-gb", type=float, default=None, help="memory per GPU (GiB; default from the GPU table)")
    g.add_argument("--intra-bw", type=float, default=None, help="per-direction GB/s in a node (default 450 on H100)")
    g.add_argument("--inter-bw", type=float, default=None, help="per-direction GB/s across nodes (default 50 on H100)")
    g.add_argument("--peak-tflops", type=float, default=None, help="dense peak (default: profiling's peak table)")
    g.add_argument("--achieved-tflops", type=float, default=None,
                   help="TFLOP/s large matmuls sustain in training (default 50%% of peak)")
    g.add_argument("--roofline-ridge", type=float, default=None,
                   help="FLOP/byte at which a kernel's memory time equals its math time; sets how much small "
                        "per-GPU matmuls and attention chunks slow down (default peak / HBM bandwidth, 295 on "
                        "H100 SXM; 0: ignore kernel shapes)")
    g = parser.add_argument_group("training")
    g.add_argument("--zero", type=int, choices=(0, 1, 2, 3), default=None,
                   help="ZeRO stage over dp_shard (0: DDP only; default: try 1, 2 and 3)")
    g.add_argument("--schedule", type=canonical_schedule, default=None,
                   help=f"pipeline schedule, one of {', '.join(SCHEDULES)} or an alias (default: try all)")
    g.add_argument("--activation-checkpointing", choices=CHECKPOINTING + ("auto",), default="auto")
    g.add_argument("--optimizer-bytes", type=float, default=16.0, help="model-state bytes per parameter (AdamW: 16)")
    g.add_argument("--margin", type=float, default=0.10, help="memory kept free (fraction)")
    for axis in ("tp", "pp", "cp"):
        g.add_argument(f"--max-{axis}", type=int, default=None, help=f"largest {axis} degree to try (1: no {axis})")
    g = parser.add_argument_group("output")
    g.add_argument("--top", type=int, default=10, help="layouts to show")
    g.add_argument("--json", action="store_true", help="print JSON instead of a table")


def run_cli(args: argparse.Namespace) -> int:
    """``meshkit plan``: print the ranked layouts (or JSON); exit 1 when none fits."""
    try:
        model = ModelSpec(layers=args.layers, hidden=args.hidden, heads=args.heads, kv_heads=args.kv_heads,
                          ffn=args.ffn, vocab=args.vocab, params=args.params)
        result = plan(model, seq_len=args.seq_len, global_batch=args.global_batch, micro_batch=args.micro_batch,
                      nodes=args.nodes, gpus_per_node=args.gpus_per_node, gpu=args.gpu, memory_gb=args.memory_gb,
                      intra_bw_gbs=args.intra_bw, inter_bw_gbs=args.inter_bw, peak_tflops=args.peak_tflops,
                      achieved_tflops=args.achieved_tflops, roofline_ridge=args.roofline_ridge,
                      zero_stage=args.zero, schedule=args.schedule,
                      activation_checkpointing=args.activation_checkpointing,
                      optimizer_bytes=args.optimizer_bytes, memory_margin=args.margin,
                      max_tp=args.max_tp, max_pp=args.max_pp, max_cp=args.max_cp)
    except ValueError as err:
        print(f"meshkit plan: {err}")
        return 2
    if args.json:
        print(json.dumps(result.to_dict(top=args.top), indent=1))
    else:
        inp = result.inputs
        print(f"{inp['params'] / 1e9:.1f}B params, seq {inp['seq_len']}, batch {inp['global_batch']} on "
              f"{inp['nodes']}×{inp['gpus_per_node']} {inp['gpu']} ({inp['memory_gb']:.0f} GB, "
              f"{inp['intra_bw_gbs']:g}/{inp['inter_bw_gbs']:g} GB/s, {inp['achieved_tflops']:.0f} of "
              f"{inp['peak_tflops']:.0f} TFLOP/s); {len(result.feasible)} of {len(result.layouts)} layouts fit")
        print(result.table(args.top))
        print(result.explanation)
    return 0 if result.best is not None else 1
