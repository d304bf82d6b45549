"""Chunk layouts of a context-parallel sequence: which tokens each cp rank holds, and how to cut and restore.

A *chunk* is ``T // (2 cp)`` tokens in the ``"load_balanced"`` layout (rank r holds chunks r and
2cp-1-r, so every rank does the same causal work) and ``T // cp`` in the ``"contiguous"`` one (rank r
holds chunk r). The bottom layer of :mod:`meshkit.plugins.context_parallel`: attention and model
integration import it, it imports neither.

Example::

    >>> layout_index(8, cp=2, layout="load_balanced").tolist()  # rank 0's shard first, then rank 1's
    [0, 1, 6, 7, 2, 3, 4, 5]
"""

from __future__ import annotations

import warnings
from datetime import timedelta
from typing import Any, Union

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from meshkit.loss import IGNORE_INDEX, items_read, mark_items

__all__ = [
    "CP_LAYOUTS",
    "P2P_TIMEOUT",
    "POSITION_KEYS",
    "IGNORE_INDEX",
    "Group",
    "process_group",
    "chunks_of_rank",
    "layout_index",
    "check_layout",
    "shard_sequence",
    "gather_sequence",
    "sequence_positions",
    "shard_batch",
    "CPBatch",
    "per_rank_mean_warning",
]

CP_LAYOUTS: tuple[str, ...] = ("load_balanced", "contiguous")
"""How a sequence is cut over the cp ranks (``layout=``)."""

P2P_TIMEOUT = timedelta(seconds=120)
"""Timeout of every wait on a point-to-point op or collective issued by context parallelism."""

POSITION_KEYS: tuple[str, ...] = ("positions", "position_ids")
"""Batch keys / forward arguments that carry token positions."""

Group = Union[ProcessGroup, DeviceMesh]


def process_group(group: Group) -> ProcessGroup:
    """The cp ProcessGroup of ``group`` (a ProcessGroup, or a 1-D DeviceMesh such as ``mesh["cp"]``)."""
    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ValueError(
                f"context_parallel: the cp mesh must be 1-D, got `mesh.ndim={group.ndim}`; pass mesh['cp']."
            )
        return group.get_group()
    return group


def chunks_of_rank(rank: int, cp: int, layout: str) -> list[int]:
    """Global chunk indices rank ``rank`` holds, in local order.

    Example::

        >>> chunks_of_rank(1, cp=3, layout="load_balanced"), chunks_of_rank(1, cp=3, layout="contiguous")
        ([1, 4], [1])
    """
    return [rank, 2 * cp - 1 - rank] if layout == "load_balanced" else [rank]


def layout_index(seq_len: int, cp: int, layout: str, device: Any = None) -> torch.Tensor:
    """(T,) natural positions in layout order: rank 0's shard first, then rank 1's, ... ."""
    n_chunks = 2 * cp if layout == "load_balanced" else cp
    chunk = seq_len // n_chunks
    base = torch.arange(seq_len, device=device).view(n_chunks, chunk)
    return torch.cat([base[c] for r in range(cp) for c in chunks_of_rank(r, cp, layout)])


def check_layout(seq_len: int, cp: int, layout: str, what: str, note: str = "") -> None:
    """Raise ValueError unless ``layout`` is known and ``seq_len`` (named ``what``) splits into its equal chunks;
    ``note`` is appended to the message."""
    if layout not in CP_LAYOUTS:
        raise ValueError(f"context_parallel: `layout={layout!r}` is not one of {CP_LAYOUTS}.")
    n = 2 * cp if layout == "load_balanced" else cp
    if seq_len % n:
        rule = "2·cp" if layout == "load_balanced" else "cp"
        raise ValueError(
            f"context_parallel: `{what}={seq_len}` must be divisible by {rule}={n} for `layout={layout!r}` "
            f"with `cp={cp}` (each rank holds {'two equal chunks' if n == 2 * cp else 'one equal chunk'}). "
            f"Pad the sequence to a multiple of {n}.{note}"
        )


def shard_sequence(x: torch.Tensor, cp_rank: int, cp: int, dim: int = 1, layout: str = "load_balanced") -> torch.Tensor:
    """This rank's shard of the full tensor ``x`` along ``dim`` (rank r: chunks r and 2cp-1-r, or chunk r).

    Example::

        >>> shard_sequence(torch.arange(8), cp_rank=1, cp=2, dim=0).tolist()
        [2, 3, 4, 5]
        >>> shard_sequence(torch.arange(8), cp_rank=1, cp=2, dim=0, layout="contiguous").tolist()
        [4, 5, 6, 7]
    """
    seq_len = x.shape[dim]
    check_layout(seq_len, cp, layout, f"x.shape[{dim}]")
    if not 0 <= cp_rank < cp:
        raise ValueError(f"shard_sequence: `cp_rank={cp_rank}` must be in [0, cp={cp}).")
    t_loc = seq_len // cp
    idx = layout_index(seq_len, cp, layout, device=x.device)[cp_rank * t_loc : (cp_rank + 1) * t_loc]
    return x.index_select(dim, idx)


def gather_sequence(x: torch.Tensor, group: Group, dim: int = 1, layout: str = "load_balanced") -> torch.Tensor:
    """Inverse of :func:`shard_sequence`: all-gather the shards of ``group`` and restore the natural order.

    Example (on every rank of a 1-D cp mesh ``mesh``)::

        >>> full = gather_sequence(shard_sequence(x, mesh.get_local_rank(), mesh.size()), mesh)  # doctest: +SKIP
    """
    pg = process_group(group)
    cp = dist.get_world_size(pg)
    check_layout(cp * x.shape[dim], cp, layout, f"cp*x.shape[{dim}]")
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(cp)]
    dist.all_gather(parts, x, group=pg, async_op=True).wait(timeout=P2P_TIMEOUT)
    full = torch.cat(parts, dim=dim)
    order = torch.argsort(layout_index(full.shape[dim], cp, layout, device=x.device))
    return full.index_select(dim, order)


def sequence_positions(
    seq_len: int, cp_rank: int, cp: int, layout: str = "load_balanced", device: Any = None
) -> torch.Tensor:
    """(seq_len / cp,) global positions of this rank's tokens, for rotary embeddings.

    Example::

        >>> sequence_positions(8, cp_rank=0, cp=2).tolist()
        [0, 1, 6, 7]
    """
    return shard_sequence(torch.arange(seq_len, device=device), cp_rank, cp, dim=0, layout=layout)


class CPBatch(dict):
    """What ``training_step`` receives under cp > 1: a dict of this rank's part of every sequence.

    A dict, so ``batch["input_ids"]`` works; used as the token tensor it replaced (``batch[:, :-1]``,
    ``batch.shape``, passed to a model) it raises an error that says what it is and how to compute
    the loss, at the first batch. ``target_counts`` (a (cp,) tensor on the batch's device) holds each cp
    rank's valid (non -100) targets of the batch and ``cp_rank`` is this rank's
    (:func:`per_rank_mean_warning` reads them).

    Example::

        >>> CPBatch({"input_ids": torch.zeros(1, 4)}).shape  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        AttributeError: NDParallelStrategy(cp>1): ...
    """

    def __getitem__(self, key: Any) -> Any:
        if not isinstance(key, str):
            raise TypeError(self._explain(f"indexed with {key!r}"))
        return super().__getitem__(key)

    def __missing__(self, key: str) -> Any:
        if key == "labels":
            raise KeyError(
                "NDParallelStrategy(cp>1): this batch has no 'labels' (the DataLoader's dicts held "
                f"{sorted(k for k in self if k != 'positions')}). With transformers pass "
                "`labels=batch['input_ids']`: meshkit shifts them over the whole sequence before sharding, so the loss "
                "is one process's. For a loss by hand, yield {'input_ids', 'labels'} with labels already shifted, or "
                "(B, T+1) token tensors. See docs/models.md."
            )
        raise KeyError(key)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(self._explain(f"asked for `.{name}`"))

    def _explain(self, use: str) -> str:
        shapes = ", ".join(f"{k!r}: {tuple(v.shape)}" for k, v in self.items() if isinstance(v, torch.Tensor))
        return (
            f"NDParallelStrategy(cp>1): the batch was {use} like a tensor, but under context parallelism it is a "
            f"dict of this rank's part of every sequence ({{{shapes}}}); a (B, T+1) token tensor is read as T "
            "inputs plus the shifted labels. Use batch['input_ids'] as the inputs and batch['labels'] as the "
            "already-shifted targets: `F.cross_entropy(logits.flatten(0, 1), batch['labels'].flatten())`, or for "
            "transformers `model(input_ids=batch['input_ids'], labels=batch['labels'], "
            "shift_labels=batch['labels']).loss` (never let the model shift them again). See docs/models.md."
        )


def _refuse_unshifted_labels(tokens: torch.Tensor, labels: Any, seq_dim: int) -> None:
    """HF collators give ``labels`` equal to ``input_ids`` (transformers shifts inside the loss); under cp
    meshkit reads ``labels`` as already shifted, so such a batch would train on the current token."""
    if not isinstance(labels, torch.Tensor) or labels.shape != tokens.shape or tokens.shape[seq_dim] < 2:
        return
    n = tokens.shape[seq_dim] - 1
    varies = bool((tokens.narrow(seq_dim, 1, n) != tokens.narrow(seq_dim, 0, n)).any())  # constant rows: undecidable
    if varies and bool(((labels == tokens) | (labels == IGNORE_INDEX)).all()):
        raise ValueError(
            "shard_batch: batch['labels'] equals batch['input_ids'] (transformers' unshifted convention, e.g. "
            "DataCollatorForLanguageModeling), but under context parallelism `labels` must already be shifted "
            "(labels[:, t] = input_ids[:, t+1]). Drop 'labels' from the batch (meshkit then shifts input_ids over the "
            "whole sequence, and `labels=batch['input_ids']` gives the one-process loss), or shift them yourself: "
            "labels = torch.cat([input_ids[:, 1:], torch.full_like(input_ids[:, :1], -100)], dim=1)."
        )


def shard_batch(
    batch: Any, cp_mesh: Group, seq_dim: int = 1, layout: str = "load_balanced", position_ids: Any = None
) -> dict[str, torch.Tensor]:
    """This cp rank's part of a batch: ``{"input_ids", "labels", "positions", ...}`` sharded along ``seq_dim``.

    ``batch`` is a dict with ``input_ids`` (and usually ``labels``, already shifted; ``positions``/``position_ids``
    if the data carries them) or a (B, T+1) token tensor, split into inputs ``[:, :-1]`` and labels ``[:, 1:]``.
    A dict without ``labels`` gets none, but its ``input_ids`` carry the next tokens of the whole sequence for
    transformers' ``labels=batch["input_ids"]`` (see :func:`~meshkit.plugins.context_parallel.apply_context_parallel`).
    Every tensor entry whose size at ``seq_dim`` equals the sequence length is sharded; ``positions``
    (B, T/cp) hold the global positions of the local tokens: 0..T-1 cut, or where given ``position_ids(input_ids)``
    of the whole (B, T) sequence (a family's own rule, e.g. RoBERTa's padding offset:
    ``meshkit.plugins.context_parallel.integration.cp_position_ids(model)``). The positions made here also ride on
    the local ``input_ids`` tensor, where :func:`~meshkit.plugins.context_parallel.apply_context_parallel`'s
    position hook reads them. With ``cp == 1`` nothing is cut.

    Example::

        >>> import torch.distributed as dist
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> out = shard_batch(torch.arange(9)[None], dist.group.WORLD)
        >>> out["input_ids"].tolist(), out["labels"].tolist(), out["positions"].tolist()
        ([[0, 1, 2, 3, 4, 5, 6, 7]], [[1, 2, 3, 4, 5, 6, 7, 8]], [[0, 1, 2, 3, 4, 5, 6, 7]])
        >>> dist.destroy_process_group()
    """
    pg = process_group(cp_mesh)
    cp, rank = dist.get_world_size(pg), dist.get_rank(pg)
    note = ""
    if isinstance(batch, torch.Tensor):
        n = batch.shape[seq_dim] - 1
        note = (f" The batch was a token tensor of {n + 1} per row, read as T={n} inputs [:, :-1] plus the shifted "
                "labels [:, 1:]: make rows T+1 tokens long.")
        batch = {"input_ids": batch.narrow(seq_dim, 0, n), "labels": batch.narrow(seq_dim, 1, n)}
    elif not isinstance(batch, dict) or "input_ids" not in batch:
        raise ValueError(
            f"shard_batch: `batch` must be a token tensor or a dict with 'input_ids', got {type(batch).__name__}"
            + (f" with keys {sorted(batch)}" if isinstance(batch, dict) else "")
            + "."
        )
    tokens = batch["input_ids"]
    seq_len = tokens.shape[seq_dim]
    check_layout(seq_len, cp, layout, f"input_ids.shape[{seq_dim}]", note)
    out = CPBatch(batch)
    made = not any(key in batch for key in POSITION_KEYS)
    if made:
        shape = tokens.shape[: seq_dim + 1]
        whole = position_ids(tokens) if position_ids is not None else None
        out["positions"] = whole if whole is not None else torch.arange(seq_len, device=tokens.device).expand(shape)
    for key, value in out.items():
        if isinstance(value, torch.Tensor) and value.dim() > seq_dim and value.shape[seq_dim] == seq_len:
            out[key] = shard_sequence(value, rank, cp, seq_dim, layout)
    if "position_ids" in out and "positions" not in out:
        out["positions"] = out["position_ids"]
    labels = batch.get("labels")
    _refuse_unshifted_labels(tokens, labels, seq_dim)
    if not isinstance(labels, torch.Tensor):
        # `{"input_ids"}` only: the targets are the next tokens of the whole sequence (none after the last),
        # shifted here, before sharding; transformers would shift each rank's load-balanced shard instead.
        ignore = torch.full_like(tokens.narrow(seq_dim, 0, 1), IGNORE_INDEX)
        labels = torch.cat([tokens.narrow(seq_dim, 1, seq_len - 1), ignore], dim=seq_dim)
    # Marks for the loss: `labels=` the batch's `input_ids` (or `labels`) means these shifted labels for
    # transformers (apply_context_parallel), so HF must not shift the local shard again; and a loss divides by
    # the cp group's mean count of targets (meshkit.loss.num_items), so the cp ranks' mean loss and gradient are
    # one process's even when the ranks hold different numbers of them (ignored labels; the rank holding a row's
    # last token has one target fewer).
    local = shard_sequence(labels, rank, cp, seq_dim, layout)
    valid = labels != IGNORE_INDEX
    counts = torch.stack([shard_sequence(valid, r, cp, seq_dim, layout).sum() for r in range(cp)])
    out.target_counts, out.cp_rank = counts, rank  # on the batch's device: no wait for it
    for key in ("input_ids", "labels"):
        if isinstance(out.get(key), torch.Tensor):
            out[key]._meshkit_cp_shifted = local
            mark_items(out[key], counts.sum() / cp)
    if made and isinstance(out["input_ids"], torch.Tensor):
        out["input_ids"]._meshkit_cp_positions = out["positions"]
    return out


_WARNED: list[bool] = [False]
_CHECKED: list[int] = [0]
CHECKED_BATCHES = 8
"""How many batches :func:`per_rank_mean_warning` reads the counts of (per process)."""


def per_rank_mean_warning(batch: Any) -> str | None:
    """After ``training_step`` on a :func:`shard_batch` batch: warn (once per process, on cp rank 0) when the
    cp ranks hold different numbers of valid targets and no loss divided by the group's count
    (:func:`meshkit.loss.num_items`): a per-rank mean such as ``F.cross_entropy(..., ignore_index=-100)``
    then weights the ranks' tokens unequally, and the gradient is not one process's. Returns the message,
    or ``None`` when there is nothing to say. meshkit cannot correct a mean it did not compute: it says so.

    Reading the counts waits for the device, so only the first :data:`CHECKED_BATCHES` batches whose loss
    did not read the count are checked (a per-rank mean meets uneven counts in nearly every batch).
    """
    counts = getattr(batch, "target_counts", None) if isinstance(batch, CPBatch) else None
    if counts is None or getattr(batch, "cp_rank", 0) != 0 or _CHECKED[0] >= CHECKED_BATCHES:
        return None
    if any(isinstance(batch.get(k), torch.Tensor) and items_read(batch[k]) for k in ("input_ids", "labels")):
        return None
    _CHECKED[0] += 1
    counts = [int(c) for c in counts.tolist()]
    if len(set(counts)) == 1:
        return None
    message = (
        f"NDParallelStrategy(cp={len(counts)}): the cp ranks hold {counts} valid (non -100) targets of this batch, "
        "and training_step's loss did not divide by the cp group's count, so a per-rank mean (e.g. "
        "`F.cross_entropy(..., ignore_index=-100)`) weights the ranks' tokens unequally and the gradient differs "
        "from one process's. Use `meshkit.loss.cross_entropy(logits, batch['labels'])`, or divide a summed loss by "
        "`meshkit.loss.num_items(batch['labels'])`. See docs/context_parallel.md, 'Loss'."
    )
    if not _WARNED[0]:
        _WARNED[0] = True
        warnings.warn(message, stacklevel=3)
    return message
