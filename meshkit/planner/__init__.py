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
efficiency) <- :mod:`.explain` (the table and the "why it wins" text of the layouts it is handed, the loss
names and the error band) <- :mod:`.search` (layouts, :func:`plan`, :func:`plan_for_world`,
:func:`auto_nd_layout`) <- :mod:`.cli` (``meshkit plan``).

Every formula is a small public function citing its source. Units: bytes, seconds, FLOP and
FLOP/s, bytes/s per direction; in the output "GB" is GiB (2**30 bytes, as torch.cuda reports
memory) and link speeds are decimal GB/s (1e9, as datasheets give them).

Mesh order is meshkit's default (``dp_replicate, dp_shard, pp, cp, tp``, outermost first), so
an axis stays inside a node when its degree times the degrees inside it fits in one node.

Example::

    >>> from meshkit.planner import ModelSpec, plan
    >>> model = ModelSpec(layers=32, hidden=4096, heads=32, ffn=11008, vocab=32000)
    >>> p = plan(model, seq_len=4096, global_batch=64, nodes=1, gpus_per_node=8,
    ...          gpu="h100-sxm", peak_tflops=989.4)
    >>> p.best.tp <= 4, p.best.feasible
    (True, True)
"""

# The public names are each layer's own __all__ (one list per name, in the module that defines it).
from meshkit.planner import cli as _cli
from meshkit.planner import costs as _costs
from meshkit.planner import explain as _explain
from meshkit.planner import model as _model
from meshkit.planner import search as _search
from meshkit.planner.cli import *  # noqa: F401,F403
from meshkit.planner.costs import *  # noqa: F401,F403
from meshkit.planner.explain import *  # noqa: F401,F403
from meshkit.planner.model import *  # noqa: F401,F403
from meshkit.planner.search import *  # noqa: F401,F403

__all__ = [*_model.__all__, *_costs.__all__, *_search.__all__, *_explain.__all__, *_cli.__all__]
