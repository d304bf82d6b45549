"""Ground floor: the token-weighted mean of a loss whose sequences are split over ranks (context parallelism).

Under cp each of the ``cp`` ranks of a group holds T/cp tokens of every sequence of its replica, and the
gradients are averaged over the group (FSDP shards over ``dp_shard × cp``). A per-rank mean over the
rank's own valid targets (``F.cross_entropy(logits, labels, ignore_index=-100)``) weights each token by
1 / (its rank's count): when the ranks hold different numbers of valid targets (ignored labels, the
position after each row's last token) the gradient is not one process's. One process's mean over the
replica's N valid targets is ``Σ_ranks Σ_local loss / N``; each rank returning ``Σ_local loss / (N / cp)``
and the group averaging gives exactly that.

:func:`meshkit.plugins.context_parallel.shard_batch` knows N before it cuts (every rank of the group holds
the whole batch then) and records ``N / cp`` on the ``input_ids`` and ``labels`` it hands out
(:func:`mark_items`); :func:`num_items` reads it and :func:`cross_entropy` divides the local sum by it.
Without the record (no cp, or a tensor that is not the batch's own, e.g. ``labels.flatten()``) both are
this rank's own count and mean, so the same ``training_step`` is right with and without cp.

Example::

    >>> import torch
    >>> from meshkit.loss import cross_entropy, mark_items, num_items
    >>> logits, labels = torch.zeros(1, 4, 8), torch.tensor([[1, 2, -100, -100]])
    >>> num_items(labels).item(), round(cross_entropy(logits, labels).item(), 4)  # no record: the local mean, ln 8
    (2.0, 2.0794)
    >>> labels = mark_items(labels, 4.0)  # e.g. cp=2, 8 valid targets in the group, 2 of them here
    >>> num_items(labels).item(), round(cross_entropy(logits, labels).item(), 4)  # the local sum / 4
    (4.0, 1.0397)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["IGNORE_INDEX", "mark_items", "num_items", "items_read", "cross_entropy"]

IGNORE_INDEX = -100
"""The label that counts for no loss (PyTorch's and transformers' ``ignore_index``)."""

_ITEMS = "_meshkit_cp_items"  # N / cp of the cp group, set by shard_batch
_READ = "_meshkit_cp_items_read"  # set once a loss divided by it (the strategy warns when nothing did)


def mark_items(tensor: torch.Tensor, items_per_rank: torch.Tensor | float) -> torch.Tensor:
    """Record on ``tensor`` (a cp batch's ``labels`` or ``input_ids``) the divisor :func:`num_items` returns:
    the cp group's valid targets divided by ``cp`` (a 0-dim tensor, kept on its device). Returns ``tensor``."""
    items = items_per_rank if isinstance(items_per_rank, torch.Tensor) else torch.tensor(float(items_per_rank))
    setattr(tensor, _ITEMS, items.to(torch.float32))
    return tensor


def num_items(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """What a local loss sum is divided by to give the replica's token mean: ``N / cp`` recorded by
    ``shard_batch`` on a cp batch's ``labels`` (or ``input_ids``), else this tensor's valid targets.
    A 0-dim float tensor on the device that holds it: nothing waits for the device.

    For a loss of your own: ``my_loss(..., reduction="sum") / num_items(batch["labels"])``.
    """
    items = getattr(labels, _ITEMS, None)
    if items is None:
        return (labels != ignore_index).sum().to(torch.float32)
    setattr(labels, _READ, True)
    return items


def items_read(tensor: torch.Tensor) -> bool:
    """Whether a loss has divided by ``tensor``'s recorded count (:func:`num_items`)."""
    return bool(getattr(tensor, _READ, False))


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor, *, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Cross-entropy of ``logits`` (..., V) against ``labels`` (...), the mean over the valid targets of the
    replica's whole sequences under cp (see the module doc), the plain mean otherwise.

    Pass the batch's own ``labels`` tensor (``batch["labels"]``, not a reshaped copy: the record is on it).
    Computed in fp32. Equals ``F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten(),
    ignore_index=ignore_index)`` without cp.
    """
    total = F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten(), ignore_index=ignore_index,
                            reduction="sum")
    return total / num_items(labels, ignore_index).clamp_min(1.0)
