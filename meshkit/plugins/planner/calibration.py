"""Published training runs the planner is calibrated against, and the fit of its free constants.

Each :class:`PublishedRun` is a configuration someone trained and measured: the model, the cluster, the
layout they chose and the MFU they reported. :func:`evaluate_run` asks the planner for exactly that layout
(``plan(..., layout=...)``) and, with ``rank=True``, how it ranks among every layout of the same cluster
(``vs_best``). :func:`fit` grid-searches the three constants of :class:`~meshkit.plugins.planner.Calibration`
on the rows marked ``fit=True``; the other rows are held out and only checked.

MFU is counted the planner's way for every row (PaLM's 6N + 12·L·h·s FLOPs per token over the dense bf16
peak, 989.4 TFLOP/s on H100 SXM), so a row published as tokens per second is converted with the same
formula the prediction uses.

Example::

    >>> from meshkit.plugins.planner.calibration import PUBLISHED, evaluate_run
    >>> row = next(r for r in PUBLISHED if r.name == "megatron-7.1b")
    >>> abs(evaluate_run(row).predicted_mfu - row.mfu) < 0.05
    True
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from meshkit.plugins.planner.costs import CALIBRATION, Calibration
from meshkit.plugins.planner.model import ModelSpec, training_flops_per_token
from meshkit.plugins.planner.search import Layout, plan

__all__ = ["PublishedRun", "PUBLISHED", "KNOWN_MISSES", "H100_PEAK_TFLOPS", "evaluate_run", "default_grid", "fit", "calibration_table"]

H100_PEAK_TFLOPS = 989.4
"""Dense bf16 peak of the H100 SXM (NVIDIA H100 datasheet), the denominator of every row's MFU."""


@dataclass(frozen=True)
class PublishedRun:
    """One published configuration: model, cluster, the layout it trained with and its MFU."""

    name: str
    source: str
    model: ModelSpec
    seq_len: int
    global_batch: int
    """Sequences per optimizer step."""
    nodes: int
    layout: str
    """The published layout as ``plan(layout=)`` takes it; fields it leaves out are the planner's choice."""
    mfu: float | None
    """Published MFU (share of the dense peak), or None where only the layout is published."""
    fit: bool
    """True: used to fit the constants; False: held out (checked only)."""
    micro_batch: int = 1
    gpus_per_node: int = 8
    note: str = ""
    memory_gb: float | None = None
    """Device memory (GiB) where the run's GPUs are not the 80 GB H100 SXM of the GPU table."""
    hbm_bw_gbs: float | None = None
    """Their memory bandwidth (GB/s), which sets the kernel-shape ridge (peak / bandwidth)."""
    published_memory_gib: float | None = None
    """Peak memory per GPU the source reports, where it does (checked against the planner's prediction)."""


def _gpt(layers: int, hidden: int, heads: int, vocab: int = 131072) -> ModelSpec:
    # Megatron-LM's GPT models: a 4h GELU MLP (8h² weights; as SwiGLU 3·h·f with f = 8h/3, derived from the count
    # and rounded like a real width, the counts then scaled back to it), full multi-head attention, untied output.
    # Dropout on: Megatron-LM's GPT defaults (--hidden-dropout 0.1, --attention-dropout 0.1); the README does not
    # say otherwise.
    params = layers * (12 * hidden * hidden + 13 * hidden) + 2 * vocab * hidden
    return ModelSpec(layers=layers, hidden=hidden, heads=heads, vocab=vocab, params=float(params), dropout=True)


def _megatron(size: str, heads: int, hidden: int, layers: int, tp: int, pp: int, gpus: int, batch: int,
              mfu: float, fit: bool) -> PublishedRun:
    dp = gpus // (tp * pp)
    return PublishedRun(
        name=f"megatron-{size}", source="Megatron-LM README, weak scaling on H100 (seq 4096, vocab 131072)",
        model=_gpt(layers, hidden, heads), seq_len=4096, global_batch=batch, nodes=gpus // 8,
        layout=f"dp_replicate=1,dp_shard={dp},pp={pp},cp=1,tp={tp},zero=1", mfu=mfu, fit=fit,
        note="distributed optimizer (ZeRO-1), sequence parallel, micro-batch 1")


LLAMA31_8B = ModelSpec(layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=128256)
LLAMA3_70B = ModelSpec(layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672, vocab=128256)
LLAMA3_405B = ModelSpec(layers=126, hidden=16384, heads=128, kv_heads=8, ffn=53248, vocab=128256)


def _tokens_mfu(model: ModelSpec, seq: int, tokens_per_s_per_gpu: float) -> float:
    flops = training_flops_per_token(model.matmul_params, model.layers, model.hidden, seq)
    return tokens_per_s_per_gpu * flops / (H100_PEAK_TFLOPS * 1e12)


_TORCHTITAN = ("torchtitan benchmarks/llama3_h100_202412_torchtitan.md (Llama 3.1 8B, bf16, FSDP, H100 96 GB HBM2e "
               "at 2.4 TB/s and 500 W, local batch 2, seq 8192, selective AC)")
# torchtitan's Grand Teton H100s: "96GB HBM2e with 2.4 TB/sec peak memory bandwidth" (95 GiB usable in torch),
# not the 80 GB SXM; its 8B runs use op-level selective AC (torchtitan's llama3_8b.toml: selective_ac_option "op").
_TT_GPU = dict(memory_gb=95.0, hbm_bw_gbs=2400.0)

# Llama 3 405B, every fact from the paper (Dubey et al. 2024, "The Llama 3 Herd of Models", arXiv 2407.21783):
# - Table 4, row 2: 16,384 H100 (80 GB HBM3, §3.3.1), TP 8, CP 1, PP 16, DP 128, seq 8,192, batch size 16 per DP
#   group, 16M tokens a batch, 400 TFLOP/s per GPU, 41 % BF16 MFU.
# - §3.3.2: "Our use of FSDP for Llama 3 shards optimizer states and gradients, but for model shards we do not
#   reshard after forward computation" -> ZeRO-2 over the 128 DP ranks.
# - §3.3.2: "we could pre-train Llama 3 on sequences of 8K tokens without activation checkpointing" -> ac=none.
# - §3.3.2: an interleaved schedule with V stages per pipeline rank; "we reduce one Transformer layer each from the
#   first and the last stages ... the first model chunk on the first stage has only the embedding, and the last
#   model chunk on the last stage has only output projection and loss calculation" -> split=balanced; a chunk of
#   only the embedding where a stage has one layer fewer means one layer per chunk: 126 + 2 = 128 chunks on 16
#   ranks, v = 8 (the paper does not print V; this is the only value both sentences allow).
_LLAMA3 = ("Llama 3 paper (Dubey et al. 2024, arXiv 2407.21783) Table 4 and §3.3.2: 16,384 H100, TP8 CP1 PP16 DP128, "
           "seq 8192, 16M tokens a step, 400 TFLOP/s/GPU, 41 % BF16 MFU; FSDP without resharding after forward, "
           "no activation checkpointing, interleaved with one layer fewer on the first and last stages")
_LLAMA3_LAYOUT = "dp_shard=128,pp=16,cp=1,tp=8,zero=2,schedule=interleaved_1f1b,v=8,ac=none,split=balanced"

PUBLISHED: tuple[PublishedRun, ...] = (
    _megatron("1.7b", 16, 2048, 24, 1, 1, 48, 192, 0.41, fit=True),
    _megatron("7.1b", 32, 4096, 30, 2, 1, 96, 192, 0.47, fit=False),
    _megatron("16b", 48, 6144, 32, 4, 1, 192, 192, 0.49, fit=True),
    _megatron("32b", 56, 7168, 48, 8, 1, 384, 192, 0.46, fit=False),
    _megatron("70b", 64, 8192, 84, 8, 2, 768, 384, 0.42, fit=True),
    _megatron("119b", 80, 10240, 92, 8, 4, 1536, 768, 0.43, fit=False),
    _megatron("177b", 96, 12288, 96, 8, 6, 2304, 1152, 0.44, fit=True),
    _megatron("314b", 128, 16384, 96, 8, 8, 3072, 1536, 0.48, fit=False),
    _megatron("462b", 144, 18432, 112, 8, 16, 6144, 3072, 0.47, fit=True),
    PublishedRun("torchtitan-8b-8gpu", _TORCHTITAN + ": 5,762 tokens/s/GPU", LLAMA31_8B, 8192, 16, 1,
                 "dp_shard=8,zero=3,ac=selective", _tokens_mfu(LLAMA31_8B, 8192, 5762), fit=True, micro_batch=2,
                 note="MFU from 5,762 tokens/s/GPU with the planner's FLOP count (torchtitan reports 33-39 %)",
                 published_memory_gib=82.4, **_TT_GPU),
    PublishedRun("torchtitan-8b-128gpu", _TORCHTITAN + ": 5,605 tokens/s/GPU", LLAMA31_8B, 8192, 256, 16,
                 "dp_shard=128,zero=3,ac=selective", _tokens_mfu(LLAMA31_8B, 8192, 5605), fit=False, micro_batch=2,
                 note="MFU from 5,605 tokens/s/GPU with the planner's FLOP count", published_memory_gib=67.0,
                 **_TT_GPU),
    PublishedRun("llama3-405b-16k", _LLAMA3, LLAMA3_405B, 8192, 2048, 2048, _LLAMA3_LAYOUT, 0.41, fit=False,
                 note="Table 4: batch size 16 per DP group = 2048 sequences of 8192 (16M tokens); the micro-batch is "
                      "not published (the planner's default, 1 sequence: m = 16)"),
    PublishedRun("seed-70b-64gpu", "seed 002, worked example (c): 70B on 64 H100, TP8 x PP8, 1F1B",
                 LLAMA3_70B, 4096, 256, 8, "dp_shard=1,pp=8,cp=1,tp=8,schedule=1f1b", None, fit=False,
                 note="no MFU published: checks the layout's vs_best only"),
)
"""The calibration table (docs/planner.md lists it with the fitted constants)."""

KNOWN_MISSES: dict[str, str] = {}
# Empty since the planner can express Llama 3's layout as trained (ZeRO-2, no AC, v = 8 with one layer fewer on the
# end stages: 41.1 % predicted, 41 % published); it was 12.5 points low when v = 8 was inexpressible and its memory
# counted dropout masks Llama has not (docs/planner.md, "Calibration").
"""Held-out rows outside ±5 MFU points, and why (the test asserts this list is exact)."""


def evaluate_run(row: PublishedRun, constants: Calibration = CALIBRATION, *, rank: bool = False) -> Layout:
    """The planner's prediction for ``row``'s own layout (with ``rank=True`` also its rank and ``vs_best``
    among every layout of the cluster; that enumerates them all, up to ~0.5 s at 16,384 GPUs)."""
    ridge = None if row.hbm_bw_gbs is None else H100_PEAK_TFLOPS * 1e12 / (row.hbm_bw_gbs * 1e9)
    result = plan(row.model, seq_len=row.seq_len, global_batch=row.global_batch, micro_batch=row.micro_batch,
                  nodes=row.nodes, gpus_per_node=row.gpus_per_node, gpu="h100-sxm", peak_tflops=H100_PEAK_TFLOPS,
                  memory_gb=row.memory_gb, roofline_ridge=ridge,
                  achieved_fraction=constants.achieved_fraction, ridge_scale=constants.ridge_scale,
                  comm_efficiency=constants.comm_efficiency, attention_fraction=constants.attention_fraction,
                  tp_overlap=constants.tp_overlap, layout=row.layout, search=rank)
    return result.named


def default_grid() -> list[Calibration]:
    """The grid :func:`fit` searches: achieved fraction 0.55-0.70 (step 0.01), ridge scale 0.1-1, attention
    fraction 0.2-0.4, comm efficiency 0.8-1. The ridge scale starts at 0.1, not 0: 0 switches the kernel-shape
    model off, and the fit rows cannot tell 0 from 0.1 (squared error 0.00186 vs 0.00202)."""
    fractions = [f / 100 for f in range(55, 71)]
    scales = (0.1, 0.2, 0.3, 0.5, 1.0)
    attention = (0.2, 0.25, 0.3, 0.35, 0.4)
    comms = (0.8, 0.9, 1.0)
    overlaps = (0.0, 0.25, 0.5, 0.75, 1.0)
    return [Calibration(achieved_fraction=a, ridge_scale=r, comm_efficiency=c, attention_fraction=f, tp_overlap=o)
            for a, r, c, f, o in itertools.product(fractions, scales, comms, attention, overlaps)]


def fit(rows: Sequence[PublishedRun] = PUBLISHED, grid: Iterable[Calibration] | None = None) -> Calibration:
    """The constants (from ``grid``, default :func:`default_grid`) that minimise the squared MFU error over the
    rows marked ``fit=True`` (about a minute for the default grid)."""
    train = [r for r in rows if r.fit and r.mfu is not None]
    best, best_err = None, float("inf")
    for constants in grid if grid is not None else default_grid():
        err = sum((evaluate_run(r, constants).predicted_mfu - r.mfu) ** 2 for r in train)
        if err < best_err:
            best, best_err = constants, err
    if best is None:
        raise ValueError("fit: the grid is empty; pass at least one Calibration.")
    return best


def calibration_table(rows: Sequence[PublishedRun] = PUBLISHED,
                      constants: Calibration = CALIBRATION) -> list[dict[str, Any]]:
    """One record per row: predicted vs published MFU of the published layout, its rank and ``vs_best``."""
    out = []
    for row in rows:
        lay = evaluate_run(row, constants, rank=True)
        out.append({"name": row.name, "held_out": not row.fit, "layout": lay.describe(),
                    "published_mfu": row.mfu, "predicted_mfu": lay.predicted_mfu,
                    "error_points": None if row.mfu is None else 100 * (lay.predicted_mfu - row.mfu),
                    "rank": lay.rank, "vs_best": lay.vs_best, "fits": lay.feasible,
                    "memory_gb": lay.memory_gb, "published_memory_gib": row.published_memory_gib,
                    "source": row.source})
    return out
