"""Layout planner: choose dp_replicate / dp_shard / pp / cp / tp for a model and a cluster.

The planner does the arithmetic a careful engineer does by hand and shows it: for every layout
of the cluster it adds up the memory per GPU (model states per ZeRO stage, activations per
pipeline schedule), the communication each parallel axis costs on the link it runs over, the
pipeline bubble, how fast the per-GPU kernels run at the shapes the layout leaves them (a soft
roofline: smaller matmuls and attention chunks sustain less of the achieved FLOP/s), and predicts
a step time and MFU. Layouts that fit in memory (with a margin) are ranked by predicted step time;
each carries a one-line reason and the plan says why the best one wins. Pure Python: no process
group, no GPU.

The package reads in layers, each importing only those before it: :mod:`.model` (the shape, its
parameters, FLOPs and memory) <- :mod:`.costs` (GPU links and peak, communication, bubble, kernel-shape
efficiency) <- :mod:`.search` (layouts, :func:`plan`, :func:`plan_for_world`, :func:`auto_nd_dims`) <-
:mod:`.explain` (the table and the "why it wins" text) <- :mod:`.cli` (``meshkit plan``).

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

from meshkit.plugins.planner.cli import configure_parser, run_cli
from meshkit.plugins.planner.costs import (
    CALIBRATION,
    DEFAULT_RIDGE,
    GPU_TABLE,
    SCHEDULES,
    Calibration,
    GpuSpec,
    attention_efficiency,
    bubble_fraction,
    cp_bytes_per_layer,
    dp_bytes_per_step,
    dp_overlap_tokens,
    gpu_spec,
    inflight_microbatches,
    matmul_efficiency,
    pp_bytes_per_boundary,
    pp_comm_ratio,
    ring_allgather_bytes,
    ring_allreduce_bytes,
    ring_time,
    roofline_efficiency,
    tp_bytes_per_layer,
    tp_comm_ratio,
)
from meshkit.plugins.planner.explain import compare, explain, format_table, header
from meshkit.plugins.planner.model import (
    CHECKPOINTING,
    FFN_MULTIPLE,
    ModelSpec,
    activation_bytes_per_layer,
    model_state_bytes,
    round_ffn,
    training_flops_per_token,
    zero3_buffer_bytes,
)
from meshkit.plugins.planner.search import (
    CPU_NOMINAL_TFLOPS,
    ERROR_BAND,
    LAYOUT_FIELDS,
    LOSSES,
    Layout,
    Plan,
    auto_nd_dims,
    parse_layout,
    plan,
    plan_for_world,
)

__all__ = [
    # inputs
    "ModelSpec",
    "FFN_MULTIPLE",
    "round_ffn",
    "GpuSpec",
    "GPU_TABLE",
    "gpu_spec",
    "SCHEDULES",
    "CHECKPOINTING",
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
    "Calibration",
    "CALIBRATION",
    # results
    "LOSSES",
    "Layout",
    "Plan",
    "plan",
    "plan_for_world",
    "auto_nd_dims",
    "CPU_NOMINAL_TFLOPS",
    "ERROR_BAND",
    "LAYOUT_FIELDS",
    "parse_layout",
    "explain",
    "format_table",
    "header",
    "compare",
    # CLI
    "configure_parser",
    "run_cli",
]
