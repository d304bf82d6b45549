"""``meshkit plan``: the command line over :func:`meshkit.planner.plan`.

Example::

    $ meshkit plan --layers 80 --hidden 8192 --heads 64 --kv-heads 8 --ffn 28672 --vocab 128256 \\
          --seq-len 4096 --global-batch 512 --nodes 8
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from meshkit.planner.costs import CALIBRATION, GPU_TABLE, PLANNED_SCHEDULES
from meshkit.planner.explain import compare, header
from meshkit.planner.model import AC_KINDS, PIPELINE_SPLITS, ModelSpec
from meshkit.planner.search import plan
from meshkit.schedules import canonical_schedule

__all__ = ["configure_parser", "run_cli"]


def _share(flag: str) -> Any:
    """An argparse type for a share in [0, 1] that also takes on (1) and off (0)."""

    def parse(text: str) -> float:
        words = {"on": 1.0, "off": 0.0}
        try:
            value = words[text.strip().lower()] if text.strip().lower() in words else float(text)
        except ValueError:
            value = -1.0
        if not 0.0 <= value <= 1.0:
            raise argparse.ArgumentTypeError(f"{flag} {text!r}: use on, off or a share in [0, 1], e.g. 0.5")
        return value

    return parse


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
    g.add_argument("--parallel-blocks", action=argparse.BooleanOptionalAction, default=False,
                   help="attention and MLP in parallel, x + attn(n(x)) + mlp(n(x)) (GPT-J, GPT-NeoX, PaLM, Falcon): "
                        "one TP reduction per pass instead of two (default off: serial blocks)")
    g.add_argument("--dropout", action=argparse.BooleanOptionalAction, default=False,
                   help="the blocks have dropout (GPT, Megatron-LM's defaults: 1-byte masks in the activations); "
                        "Llama-style models have none (default off)")
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
                   help="TFLOP/s large matmuls sustain in training (default: --achieved-fraction of peak)")
    g.add_argument("--achieved-fraction", type=float, default=None,
                   help="share of peak large matmuls sustain (default: the GPU's fitted share, "
                        + ", ".join(f"{g} {v:g}" for g, v in CALIBRATION.gemm_efficiency)
                        + f"; {CALIBRATION.achieved_fraction:g} for another GPU)")
    g.add_argument("--comm-efficiency", type=float, default=None,
                   help=f"share of the link bandwidths collectives reach (default {CALIBRATION.comm_efficiency:g})")
    g.add_argument("--ridge-scale", type=float, default=None,
                   help=f"kernel-shape ridge as a share of --roofline-ridge (default {CALIBRATION.ridge_scale:g}, "
                        "fitted)")
    g.add_argument("--attention-fraction", type=float, default=None,
                   help="fused attention's rate as a share of the matmuls' (default: the GPU's fitted share, "
                        + ", ".join(f"{g} {v:g}" for g, v in CALIBRATION.attention_by_gpu)
                        + f"; {CALIBRATION.attention_fraction:g} for another GPU)")
    g.add_argument("--tp-overlap", type=_share("--tp-overlap"), default=None,
                   help="share of the TP collectives hidden behind the GEMMs: on (1), off (0) or a share in 0..1 "
                        f"(default {CALIBRATION.tp_overlap:g}, fitted; off: all exposed, e.g. without async TP or "
                        "Megatron-LM's --tp-comm-overlap)")
    g.add_argument("--roofline-ridge", type=float, default=None,
                   help="FLOP/byte at which a kernel's memory time equals its math time; sets how much small "
                        "per-GPU matmuls and attention chunks slow down (default peak / HBM bandwidth, 295 on "
                        "H100 SXM; 0: ignore kernel shapes)")
    g = parser.add_argument_group("training")
    g.add_argument("--zero", type=int, choices=(0, 1, 2, 3), default=None,
                   help="ZeRO stage over dp_shard (0: DDP only; default: try 1, 2 and 3)")
    g.add_argument("--schedule", type=canonical_schedule, default=None,
                   help=f"pipeline schedule, one of {', '.join(PLANNED_SCHEDULES)} or an alias (default: try all)")
    g.add_argument("--activation-checkpointing", choices=AC_KINDS + ("auto",), default="auto",
                   help="none, selective (meshkit's: every matmul and attention output kept), full, torchtitan_op "
                        "(torchtitan's op-level SAC, as a published run states it; never tried by auto), or auto "
                        "(try none, selective, full)")
    g.add_argument("--pipeline-split", choices=PIPELINE_SPLITS + ("auto",), default="even",
                   help="how a pipeline spreads the blocks: even, or balanced (the embedding and the output layer "
                        "take a block's slot each, as Llama 3 trained); auto tries both (default even)")
    g.add_argument("--optimizer-bytes", type=float, default=16.0, help="model-state bytes per parameter (AdamW: 16)")
    g.add_argument("--margin", type=float, default=0.10, help="memory kept free (fraction)")
    g.add_argument("--sequence-parallel", action=argparse.BooleanOptionalAction, default=True,
                   help="TP activations sharded over the sequence (Megatron/torchtitan SP; default on; per layout: "
                        "--layout ...,sp=0)")
    g.add_argument("--flash-attention", action=argparse.BooleanOptionalAction, default=True,
                   help="fused attention (FlashAttention / SDPA: no s×s scores kept or streamed; default on); "
                        "--no-flash-attention: eager attention, its scores through memory")
    g.add_argument("--fused-elementwise", action=argparse.BooleanOptionalAction, default=False,
                   help="the elementwise ops are fused (torch.compile, Megatron-LM's fused kernels; default off)")
    g.add_argument("--dp-overlap", action=argparse.BooleanOptionalAction, default=True,
                   help="the data-parallel collectives overlap compute (bucketed all-reduce, FSDP prefetch, "
                        "Megatron-LM's --overlap-grad-reduce; default on); --no-dp-overlap: all of it exposed")
    g.add_argument("--layout", default=None,
                   help="evaluate exactly this layout beside the best, e.g. "
                        "'dp_replicate=1,dp_shard=1,pp=8,cp=1,tp=8[,zero=1,schedule=1f1b,v=1,m=256,ac=none]' with the "
                        "software facts a published run states: sp=0/1, flash=0/1, tp_overlap=0..1, fused=0/1, "
                        "dp_overlap=0/1, ac=none/selective/full/torchtitan_op, zero=0..3")
    for axis in ("tp", "pp", "cp"):
        g.add_argument(f"--max-{axis}", type=int, default=None, help=f"largest {axis} degree to try (1: no {axis})")
    g = parser.add_argument_group("output")
    g.add_argument("--top", type=int, default=10, help="layouts to show")
    g.add_argument("--json", action="store_true", help="print JSON instead of a table")


def run_cli(args: argparse.Namespace) -> int:
    """``meshkit plan``: print the ranked layouts (or JSON); exit 1 when none fits."""
    # a ValueError propagates: meshkit.cli prints `meshkit plan: error: ...` on stderr, exit 2
    model = ModelSpec(layers=args.layers, hidden=args.hidden, heads=args.heads, kv_heads=args.kv_heads,
                      ffn=args.ffn, vocab=args.vocab, params=args.params, dropout=args.dropout,
                      parallel_blocks=args.parallel_blocks)
    result = plan(model, seq_len=args.seq_len, global_batch=args.global_batch, micro_batch=args.micro_batch,
                  nodes=args.nodes, gpus_per_node=args.gpus_per_node, gpu=args.gpu, memory_gb=args.memory_gb,
                  intra_bw_gbs=args.intra_bw, inter_bw_gbs=args.inter_bw, peak_tflops=args.peak_tflops,
                  achieved_tflops=args.achieved_tflops, roofline_ridge=args.roofline_ridge,
                  achieved_fraction=args.achieved_fraction, comm_efficiency=args.comm_efficiency,
                  ridge_scale=args.ridge_scale, attention_fraction=args.attention_fraction,
                  tp_overlap=args.tp_overlap, pipeline_split=args.pipeline_split,
                  sequence_parallel=args.sequence_parallel, flash_attention=args.flash_attention,
                  fused_elementwise=args.fused_elementwise, dp_overlap=args.dp_overlap, layout=args.layout,
                  zero_stage=args.zero, schedule=args.schedule,
                  activation_checkpointing=args.activation_checkpointing,
                  optimizer_bytes=args.optimizer_bytes, memory_margin=args.margin,
                  max_tp=args.max_tp, max_pp=args.max_pp, max_cp=args.max_cp)
    if args.json:
        print(json.dumps(result.to_dict(top=args.top), indent=1))
    else:
        print("\n".join(header(result)))
        print(result.table(args.top))
        print(result.explanation)
        if result.named is not None:
            print(compare(result.named, result.best))
    return 0 if result.best is not None else 1

