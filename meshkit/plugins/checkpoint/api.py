"""The two calls a front door makes: :func:`save_checkpoint` and :func:`load_checkpoint`, either format.

A strategy (the Trainer's :class:`~meshkit.plugins.strategy.NDParallelStrategy`, or a Fabric one) gathers
the states (the model's state dict, each optimizer's state, the rest) and passes them with its rank and
barrier; these functions choose the format, repair a publish a crash interrupted, verify, and load. They
take and return plain data: no Lightning object.

Example::

    >>> from meshkit.plugins.checkpoint import load_checkpoint, save_checkpoint, tied_aliases
    >>> save_checkpoint("ckpts/last.ckpt", model_state, [optimizer_state], {"global_step": 10},
    ...                 tied=tied_aliases(model))  # doctest: +SKIP
    >>> meta = load_checkpoint("ckpts/last.ckpt", model, [optimizer])  # doctest: +SKIP
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence

from torch import nn

from meshkit.plugins.checkpoint.atomic import check_published, repair, repair_file
from meshkit.plugins.checkpoint.errors import CheckpointError
from meshkit.plugins.checkpoint.manifest import verify_file
from meshkit.plugins.checkpoint.sharded import barrier_of, load_sharded, rank_of, save_sharded
from meshkit.plugins.checkpoint.single import check_full_file, load_file, save_file

__all__ = ["save_checkpoint", "load_checkpoint"]


def save_checkpoint(path: str | os.PathLike, model_state: dict[str, Any], optimizer_states: Optional[Sequence[Any]],
                    meta: dict[str, Any], *, tied: Optional[dict[str, str]] = None, sharded: bool = True,
                    rank: Optional[int] = None, barrier: Optional[Callable[[], None]] = None) -> None:
    """Every rank: a sharded (DCP) folder (:func:`~meshkit.plugins.checkpoint.sharded.save_sharded`), or with
    ``sharded=False`` one file written by rank 0 (:func:`~meshkit.plugins.checkpoint.single.save_file`: then
    rank 0's ``model_state`` is the full one); atomic either way. ``path`` is the same on every rank.

    Example::

        >>> save_checkpoint("last.ckpt", {"w": torch.ones(2)}, None, {"global_step": 1})  # doctest: +SKIP
    """
    if sharded:
        save_sharded(path, model_state, optimizer_states, meta, tied=tied, rank=rank, barrier=barrier)
        return
    if rank_of(rank) == 0:
        save_file(path, model_state, optimizer_states, meta, tied=tied)
    barrier_of(barrier)()


def load_checkpoint(path: str | os.PathLike, module: nn.Module, optimizers: Iterable[Any] = (), *,
                    weights_only: Optional[bool] = None, strict: bool = True, rank: Optional[int] = None,
                    world_size: Optional[int] = None, barrier: Optional[Callable[[], None]] = None,
                    pp_group: Any = None, allow_unverified: bool = False) -> dict[str, Any]:
    """Every rank: load ``path`` (a folder: :func:`~meshkit.plugins.checkpoint.sharded.load_sharded`; a file,
    once verified and found to be a Lightning checkpoint: :func:`~meshkit.plugins.checkpoint.single.load_file`)
    into ``module`` and ``optimizers``; returns the rest of the checkpoint (the trainer state).

    ``weights_only`` defaults to True: never unpickle arbitrary objects from a checkpoint's metadata.
    A crash in the middle of a publish is repaired first (rank 0), so ``path`` is the newest complete copy.
    ``strict=False`` admits missing and unexpected keys; ``pp_group``: this rank's pipeline group (pp > 1).
    A checkpoint without its integrity record (a folder's ``meshkit.json``, a file's sidecar) is refused unless
    ``allow_unverified=True``; meshkit's temporary ``.NAME.partial`` / ``.NAME.old`` always are.

    Example::

        >>> meta = load_checkpoint("ckpts/last.ckpt", model, [optimizer])  # doctest: +SKIP
    """
    weights_only = True if weights_only is None else weights_only
    given, path, rank = path, Path(path), rank_of(rank)
    check_published(path, f"ckpt_path={str(given)!r}")  # every rank: the path is the same on all
    if rank == 0:
        repair(path)
        repair_file(path)
    barrier_of(barrier)()
    if path.is_dir():  # optimizer states keyed by parameter FQN: loads at any pp / layout
        return load_sharded(path, module, optimizers, weights_only=weights_only, strict=strict, rank=rank,
                            world_size=world_size, pp_group=pp_group, allow_unverified=allow_unverified)
    if not path.is_file():
        raise CheckpointError(f"`ckpt_path={str(given)!r}` does not exist. Pass an existing checkpoint.")
    verify_file(path, allow_unverified=allow_unverified)
    check_full_file(path)
    return load_file(path, module, optimizers, weights_only=weights_only, strict=strict)
