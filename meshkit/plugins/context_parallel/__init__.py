"""Context parallelism: sequence sharding and ring / all-gather / Ulysses attention over a cp group.

Each of the ``cp`` ranks of a cp group holds ``T / cp`` tokens of every sequence. In the
``"load_balanced"`` layout the sequence is cut into ``2·cp`` chunks and rank r holds chunks r and
2·cp−1−r, so every rank does the same causal-attention work; ``"contiguous"`` gives rank r chunk r
of ``cp``. Attention runs on those shards with one of three schemes (``attention=``):

- ``"ring"``: K/V blocks travel around the group by isend/irecv while the block in hand is attended;
  partial outputs merge by log-sum-exp; backward sends the dK/dV accumulators around the ring.
  Sends per rank per layer: forward (cp−1)·|K,V|_local, backward (cp−1)·|K,V| + cp·|dK,dV|.
- ``"allgather"``: all-gather K/V, attend with the local queries, reduce-scatter dK/dV (Llama 3).
- ``"ulysses"``: all-to-all from sequence-sharded to head-sharded, full attention on H/cp heads,
  all-to-all back (heads rule: :func:`check_cp_heads`).

Rotary embeddings must use each token's *global* position: :func:`shard_batch` returns them, and
:func:`apply_context_parallel` feeds them to models that were not given any.

Modules, each importing only those before it: :mod:`.layout` (chunk layouts, sharding, batches),
:mod:`.attention` (block math, the three variants, :func:`context_parallel_attention`),
:mod:`.integration` (:func:`apply_context_parallel`), :mod:`.steps` (:func:`step_batch`, :func:`step_loss`: what a
training loop does differently under cp, for the Trainer's strategy and a Fabric loop alike).

Example (2 ranks, run with torchrun)::

    >>> import torch                                                      # doctest: +SKIP
    >>> from torch.distributed.device_mesh import init_device_mesh
    >>> from meshkit.plugins.context_parallel import context_parallel_attention, shard_sequence
    >>> mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    >>> q = k = v = torch.randn(1, 4, 16, 8)                              # full (B, H, T, D), same on all ranks
    >>> ql, kl, vl = (shard_sequence(t, mesh.get_local_rank(), 2, dim=2) for t in (q, k, v))
    >>> out = context_parallel_attention(ql, kl, vl, mesh, attention="ring")  # (1, 4, 8, 8): this rank's rows
"""

from meshkit.plugins.context_parallel.attention import CP_ATTENTIONS, check_cp_heads, context_parallel_attention
from meshkit.plugins.context_parallel.integration import (
    CPApplied,
    apply_context_parallel,
    check_cp_batch,
    check_cp_forward,
    check_cp_mask,
    context_parallel_layout,
    cp_applied,
    cp_position_ids,
)
from meshkit.plugins.context_parallel.steps import step_batch, step_loss
from meshkit.plugins.context_parallel.layout import (
    CP_LAYOUTS,
    CPBatch,
    chunks_of_rank,
    check_layout,
    gather_sequence,
    layout_index,
    per_rank_mean_warning,
    sequence_positions,
    shard_batch,
    shard_sequence,
)

__all__ = [
    "CP_ATTENTIONS",
    "CP_LAYOUTS",
    "check_cp_heads",
    "check_layout",
    "chunks_of_rank",
    "layout_index",
    "context_parallel_attention",
    "shard_sequence",
    "gather_sequence",
    "sequence_positions",
    "shard_batch",
    "CPBatch",
    "per_rank_mean_warning",
    "CPApplied",
    "apply_context_parallel",
    "check_cp_batch",
    "check_cp_forward",
    "check_cp_mask",
    "context_parallel_layout",
    "cp_applied",
    "cp_position_ids",
    "step_batch",
    "step_loss",
]
