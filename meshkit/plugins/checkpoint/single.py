"""Single-file checkpoints (``save_distributed_checkpoint=False``) and the files ``meshkit consolidate`` writes.

One rank writes the whole state with ``torch.save`` to ``.NAME.partial`` with its sidecar
``NAME.meshkit.json`` (:func:`~meshkit.plugins.checkpoint.atomic.publish_file`), renamed into place; a
tied parameter is stored once, as in a DCP folder. A load verifies the sidecar, refuses a file that is
not a Lightning checkpoint (:func:`check_full_file`), and fills the tied names in before loading
(:func:`load_file`). :func:`load_weights` reads an exported ``{name: tensor}`` file, verified.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

import torch
from torch import nn

from meshkit.plugins.checkpoint.atomic import check_published, publish_file, remove, repair, siblings
from meshkit.plugins.checkpoint.errors import REGISTER, CheckpointError, UnsafeCheckpointError, refusal
from meshkit.plugins.checkpoint.manifest import verify_file
from meshkit.plugins.checkpoint.state import (
    MODEL,
    OPTIMIZERS,
    TIED_WEIGHTS,
    tied_aliases,
    with_tied_aliases,
    without_aliases,
)

__all__ = ["save_file", "load_file", "check_full_file", "load_weights"]


def save_file(path: str | os.PathLike, model_state: dict[str, Any], optimizer_states: Optional[Sequence[Any]],
              meta: dict[str, Any], *, tied: Optional[dict[str, str]] = None) -> None:
    """One rank (the one holding the full state): the checkpoint as one file at ``path``, atomically, with its
    sidecar; a sharded checkpoint of the same name is replaced only once the file is complete.

    ``model_state``: the full model state dict; ``tied``: ``{alias: canonical}``, stored once under the
    canonical name (recorded under :data:`~meshkit.plugins.checkpoint.state.TIED_WEIGHTS`);
    ``optimizer_states``: torch's optimizer state dicts (None: a weights-only save, no entry); ``meta``:
    everything else.

    Example::

        >>> save_file("last.ckpt", model.state_dict(), [opt.state_dict()], {"global_step": 3})  # doctest: +SKIP
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)  # as Lightning's own writer: ModelCheckpoint's folder may be new
    partial, old = siblings(path)
    repair(path)
    remove(partial)  # a stale one, file or folder
    remove(old)

    def make_room() -> None:
        if path.is_dir():  # a sharded checkpoint of the same name
            os.rename(path, old)

    aliases = dict(tied or {})  # one FQN per tied parameter, as in a DCP folder
    checkpoint = {**meta, MODEL: without_aliases(model_state, aliases)}
    if optimizer_states is not None:
        checkpoint[OPTIMIZERS] = list(optimizer_states)
    checkpoint[TIED_WEIGHTS] = aliases
    publish_file(path, lambda f: torch.save(checkpoint, f), make_room)
    remove(old)


def check_full_file(path: Path) -> None:
    """A single-file ``ckpt_path`` must be a Lightning checkpoint (a dict with ``state_dict``), not bare weights."""
    import pickle

    try:
        obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as e:
        raise UnsafeCheckpointError(
            f"checkpoint `{path}` is not a readable torch file: it holds an object outside torch's weights_only "
            f"allowlist ({refusal(e)}), which meshkit does not unpickle. {REGISTER}"
        ) from None
    except (RuntimeError, EOFError, OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint `{path}` is not a readable torch file ({type(e).__name__}: {e}).") from None
    if not isinstance(obj, dict) or not isinstance(obj.get(MODEL), dict):
        what = f"a dict with keys {sorted(map(str, obj))[:5]}" if isinstance(obj, dict) else f"a {type(obj).__name__}"
        raise CheckpointError(
            f"`ckpt_path={str(path)!r}` is {what}, not a Lightning checkpoint (no `state_dict` entry). Pass a folder "
            "or file `trainer.save_checkpoint` wrote; to start from exported weights, load them into the model "
            "before `fit` (`model.load_state_dict(torch.load(path))`) and pass no ckpt_path."
        )


def load_file(path: str | os.PathLike, module: nn.Module, optimizers: Iterable[Any] = (), *,
              weights_only: bool = True, strict: bool = True) -> dict[str, Any]:
    """Every rank: a single-file checkpoint into ``module`` and ``optimizers``; returns the rest of the file.

    Lightning's own full-file load (``lightning.fabric``'s, which both front doors share), with the tied
    names filled in first (:func:`~meshkit.plugins.checkpoint.state.with_tied_aliases`): a file stores a tied
    parameter once, and loads into the model tied or untied, as a DCP folder does. It does not verify the
    file: :func:`~meshkit.plugins.checkpoint.api.load_checkpoint` does that (and :func:`check_full_file`) first.

    Example::

        >>> meta = load_file("last.ckpt", model, [optimizer])  # doctest: +SKIP
    """
    from lightning.fabric.strategies.model_parallel import _load_raw_module_state, _rekey_optimizer_state_if_needed
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    checkpoint = torch.load(path, mmap=True, map_location="cpu", weights_only=weights_only)
    saved = checkpoint[MODEL]
    state = with_tied_aliases(checkpoint.pop(MODEL), module, checkpoint.get(TIED_WEIGHTS, {}))
    untied = set(state) - set(saved) - set(tied_aliases(module))  # an untied head from a tied checkpoint
    _load_raw_module_state(state, module, strict=strict)  # Lightning's loader (lightning 2.6), one call per module
    opts = StateDictOptions(broadcast_from_rank0=True, full_state_dict=True, strict=strict and not untied)
    for optimizer, optimizer_state in zip(optimizers, checkpoint.get(OPTIMIZERS, [])):
        optimizer = getattr(optimizer, "_optimizer", optimizer)
        if not optimizer_state["state"]:  # e.g. SGD without momentum: Lightning's rekeying and torch's load both fail
            for group, saved_group in zip(optimizer.param_groups, optimizer_state["param_groups"]):
                group.update({k: v for k, v in saved_group.items() if k != "params"})
            continue
        optimizer_state = _rekey_optimizer_state_if_needed(optimizer_state, module)
        set_optimizer_state_dict(module, optimizer, optim_state_dict=optimizer_state, options=opts)
    return checkpoint


def load_weights(path: str | os.PathLike, map_location: Any = "cpu", *,
                 allow_unverified: bool = False) -> dict[str, torch.Tensor]:
    """Load a file ``consolidate_checkpoint`` wrote, verified against its sidecar, with ``weights_only=True``.

    A file without a sidecar, or consolidated from an unverified checkpoint, is refused unless
    ``allow_unverified=True``.

    Example::

        >>> model.load_state_dict(load_weights("model.pt"))  # doctest: +SKIP
    """
    check_published(Path(path))
    verify_file(path, allow_unverified=allow_unverified)
    return torch.load(path, map_location=map_location, weights_only=True)
