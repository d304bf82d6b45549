"""The two things a training loop does differently under context parallelism, for both front doors.

Under cp > 1 every batch is cut over the cp ranks before the model sees it (:func:`step_batch`), and the
loss a rank computes is its part of the replica's loss (``Σ_local / (N / cp)``, see :mod:`meshkit.loss`),
so the value a loop reports is the mean over dp × cp (:func:`step_loss`). The Trainer's
:class:`~meshkit.plugins.strategy.NDParallelStrategy` calls them from ``batch_to_device`` and
``training_step``; a Fabric loop calls them through
:meth:`~meshkit.plugins.fabric.NDParallelFabricStrategy.shard_batch` and
:meth:`~meshkit.plugins.fabric.NDParallelFabricStrategy.loss_mean`. Without cp both return their input.

Example (``dims`` a built :class:`~meshkit.plugins.dims.ParallelDims`)::

    >>> applied = cp_applied(model)                                     # doctest: +SKIP
    >>> batch = step_batch(batch, dims, "load_balanced", applied)      # doctest: +SKIP
    >>> loss = step_loss(model(**batch).loss, batch, dims)             # doctest: +SKIP
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist

from meshkit.plugins.context_parallel.integration import CPApplied, check_cp_batch
from meshkit.plugins.context_parallel.layout import per_rank_mean_warning, shard_batch

if TYPE_CHECKING:
    from meshkit.plugins.dims import ParallelDims

__all__ = ["step_batch", "step_loss"]


def _cp_on(dims: Optional["ParallelDims"]) -> bool:
    return dims is not None and dims.cp_enabled


def step_batch(
    batch: Any, dims: Optional["ParallelDims"], layout: str, applied: Optional[CPApplied], mask: bool = True
) -> Any:
    """This rank's part of ``batch`` under cp > 1 (:func:`~meshkit.plugins.context_parallel.shard_batch` over
    ``mesh["cp"]``: a :class:`~meshkit.plugins.context_parallel.CPBatch`); ``batch`` itself otherwise.

    ``applied`` (the trained model's :func:`~meshkit.plugins.context_parallel.cp_applied` record, resolved once
    at set-up, or None) gives the family's own position ids and is checked against the cut batch
    (:func:`~meshkit.plugins.context_parallel.check_cp_batch`: a sliding window shorter than the sequence and,
    unless ``mask=False`` because the caller checked it on the host, a padding mask), before the step's first
    collective. No module walk, no device sync besides the mask's. Call it after the batch is on its device (the
    cut records the targets' counts on the tensors it returns)."""
    if not _cp_on(dims):
        return batch
    rule = applied.position_ids if applied is not None else None  # RoBERTa's offset, ...; None: 0..T-1
    batch = shard_batch(batch, dims.submesh("cp"), layout=layout, position_ids=rule)
    if applied is not None:
        check_cp_batch(applied, batch, dims.cp, mask=mask)
    return batch


def step_loss(output: Any, batch: Any, dims: Optional["ParallelDims"]) -> Any:
    """``output`` (a loss tensor, or a dict with ``"loss"``) with the loss's value averaged over the dp × cp ranks
    (every rank the same: the loss of the global batch) and its gradient the local one, which FSDP averages.

    Under cp it also warns once when the loss was a per-rank mean over uneven target counts
    (:func:`~meshkit.plugins.context_parallel.per_rank_mean_warning`): call it after the loss is computed. One
    all-reduce over ``dims.submesh("dp_cp")``. Without cp, ``output`` unchanged.
    """
    if not _cp_on(dims):
        return output
    per_rank_mean_warning(batch)
    loss = output["loss"] if isinstance(output, dict) else output
    if not isinstance(loss, torch.Tensor):
        return output
    mean = loss.detach().clone()
    dist.all_reduce(mean, op=dist.ReduceOp.AVG, group=dims.submesh("dp_cp").get_group())
    loss = loss + (mean - loss.detach())
    return {**output, "loss": loss} if isinstance(output, dict) else loss
