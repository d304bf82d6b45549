"""``meshkit plan``: the command line over :func:`meshkit.plugins.planner.plan`.

Example::

    $ meshkit plan --layers 80 --hidden 8192 --heads 64 --kv-heads 8 --ffn 28672 --vocab 128256 \\
          --seq-len 4096 --global-batch 512 --nodes 8
"""

from __future__ import annotations

import argparse
import json

from meshkit.plugins.planner.costs import CALIBRATION, GPU_TABLE, SCHEDULES
from meshkit.plugins.planner.explain import compare, header
from meshkit.plugins.planner.model import CHECKPOINTING, PIPELINE_SPLITS, ModelSpec
from meshkit.plugins.planner.search import plan
from meshkit.schedules import canonical_schedule

__all__ = ["configure_parser", "run_cli"]


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
                   help=f"share of peak large matmuls sustain (default {CALIBRATION.achieved_fraction:g}, fitted)")
    g.add_argument("--comm-efficiency", type=float, default=None,
                   help=f"share of the link bandwidths collectives reach (default {CALIBRATION.comm_efficiency:g}, "
                        "fitted)")
    g.add_argument("--ridge-scale", type=float, default=None,
                   help=f"kernel-shape ridge as a share of --roofline-ridge (default {CALIBRATION.ridge_scale:g}, "
                        "fitted)")
    g.add_argument("--attention-fraction", type=float, default=None,
                   help="fused attention's rate as a share of the matmuls' (default "
                        f"{CALIBRATION.attention_fraction:g}, fitted)")
    g.add_argument("--tp-overlap", type=float, default=None,
                   help=f"share of the TP collectives hidden behind the GEMMs, 0..1 (default {CALIBRATION.tp_overlap:g}, "
                        "fitted; 0: all exposed, e.g. without async TP)")
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
    g.add_argument("--pipeline-split", choices=PIPELINE_SPLITS + ("auto",), default="even",
                   help="how a pipeline spreads the blocks: even, or balanced (the embedding and the output layer "
                        "take a block's slot each, as Llama 3 trained); auto tries both (default even)")
    g.add_argument("--optimizer-bytes", type=float, default=16.0, help="model-state bytes per parameter (AdamW: 16)")
    g.add_argument("--margin", type=float, default=0.10, help="memory kept free (fraction)")
    g.add_argument("--sequence-parallel", action=argparse.BooleanOptionalAction, default=True,
                   help="TP activations sharded over the sequence (Megatron/torchtitan SP; default on)")
    g.add_argument("--layout", default=None,
                   help="evaluate exactly this layout beside the best, e.g. "
                        "'dp_replicate=1,dp_shard=1,pp=8,cp=1,tp=8[,zero=1,schedule=1f1b,v=1,m=256,ac=none]'")
    for axis in ("tp", "pp", "cp"):
        g.add_argument(f"--max-{axis}", type=int, default=None, help=f"largest {axis} degree to try (1: no {axis})")
    g = parser.add_argument_group("output")
    g.add_argument("--top", type=int, default=10, help="layouts to show")
    g.add_argument("--json", action="store_true", help="print JSON instead of a table")


def run_cli(args: argparse.Namespace) -> int:
    """``meshkit plan``: print the ranked layouts (or JSON); exit 1 when none fits."""
    # a ValueError propagates: meshkit.cli prints `meshkit plan: error: ...` on stderr, exit 2
    model = ModelSpec(layers=args.layers, hidden=args.hidden, heads=args.heads, kv_heads=args.kv_heads,
                      ffn=args.ffn, vocab=args.vocab, params=args.params, dropout=args.dropout)
    result = plan(model, seq_len=args.seq_len, global_batch=args.global_batch, micro_batch=args.micro_batch,
                  nodes=args.nodes, gpus_per_node=args.gpus_per_node, gpu=args.gpu, memory_gb=args.memory_gb,
                  intra_bw_gbs=args.intra_bw, inter_bw_gbs=args.inter_bw, peak_tflops=args.peak_tflops,
                  achieved_tflops=args.achieved_tflops, roofline_ridge=args.roofline_ridge,
                  achieved_fraction=args.achieved_fraction, comm_efficiency=args.comm_efficiency,
                  ridge_scale=args.ridge_scale, attention_fraction=args.attention_fraction,
                  tp_overlap=args.tp_overlap, pipeline_split=args.pipeline_split,
                  sequence_parallel=args.sequence_parallel, layout=args.layout,
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


if __name__ == "__main__":  # a library module, not a command: it names its verb and exits 2
    from meshkit.verbs import not_a_command

    not_a_command("meshkit.plugins.planner.cli")
