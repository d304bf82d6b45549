"""Sharded (DCP) checkpoints: an atomic, hashed save and a verified, safe, strict load that reshards.

A save (:func:`save_sharded`, every rank) never leaves a half-written checkpoint under its name:

1. every rank writes its shard into a temporary sibling ``.NAME.partial`` (DCP fsyncs each file);
2. each rank hashes its own files as they are written (CRC-32) and rank 0 gathers the hashes;
3. rank 0 writes ``meta.pt`` and then the manifest ``meshkit.json`` (every file with its writer rank,
   size and hash), fsynced: the manifest is the commit marker, written last;
4. rank 0 publishes: the old ``NAME`` (if any) is renamed to ``.NAME.old``, ``.NAME.partial`` to
   ``NAME``, then ``.NAME.old`` is removed. A crash between the renames is repaired on the next
   load or save (the newest complete copy wins), so ``NAME`` always names a complete checkpoint.

A load (:func:`load_sharded`) checks the manifest and every hash (the files split over the ranks),
reads ``.metadata`` and non-tensor entries without running code (:mod:`~meshkit.plugins.checkpoint.reader`),
and compares keys and shapes with the model (:func:`check_fits`) before any weight is touched; DCP
reshards, so a checkpoint saved at one layout resumes at another.

Plain functions of paths, state dicts, ranks and process groups: a front door (the Trainer's strategy,
a Fabric strategy) gathers the states and calls them. ``rank`` / ``world_size`` default to the default
process group's (0 / 1 without one); ``barrier`` to ``torch.distributed.barrier()`` when a group of more
than one rank exists (a strategy passes its own, e.g. with NCCL device ids).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Callable, Collection, Iterable, Optional, Sequence

import torch
from torch import nn

from meshkit.plugins.checkpoint.atomic import check_published, fsync_dir, remove, repair, siblings, write_synced
from meshkit.plugins.checkpoint.errors import REGISTER, CheckpointError, UnsafeCheckpointError, refusal
from meshkit.plugins.checkpoint.manifest import (
    MANIFEST,
    META,
    encode_manifest,
    file_entry,
    hashing_writer,
    sidecar,
    torch_crc32_off,
    verify_checkpoint,
)
from meshkit.plugins.checkpoint.reader import SafeReader, dcp_errors, read_metadata, safe_load_planner
from meshkit.plugins.checkpoint.state import (
    MODEL,
    TIED_WEIGHTS,
    flat_optimizer_state,
    optimizer_key,
    tied_load_plan,
    without_aliases,
)

__all__ = ["save_sharded", "load_sharded", "check_fits", "gather_keys", "rank_of", "world_of", "barrier_of"]

log = logging.getLogger(__name__)
_fault_hook: Optional[Callable[[str, Path], None]] = None  # tests: (phase, path) at each save phase


def rank_of(rank: Optional[int] = None) -> int:
    """``rank``, or the default process group's rank (0 without one)."""
    import torch.distributed as dist

    if rank is not None:
        return rank
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def world_of(size: Optional[int] = None) -> int:
    """``size``, or the default process group's size (1 without one)."""
    import torch.distributed as dist

    if size is not None:
        return size
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def barrier_of(barrier: Optional[Callable[[], None]] = None) -> Callable[[], None]:
    """``barrier``, or ``torch.distributed.barrier`` on the default group (nothing to wait for without one)."""
    import torch.distributed as dist

    if barrier is not None:
        return barrier
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.barrier
    return lambda: None


def _at(phase: str, path: Path) -> None:
    if _fault_hook is not None:
        _fault_hook(phase, path)


# ---- save ---------------------------------------------------------------------------------------
def save_sharded(path: str | os.PathLike, model_state: dict[str, Any], optimizer_states: Optional[Sequence[Any]],
                 meta: dict[str, Any], *, tied: Optional[dict[str, str]] = None, rank: Optional[int] = None,
                 barrier: Optional[Callable[[], None]] = None) -> None:
    """Every rank: an atomic, hashed DCP folder at ``path`` (steps in the module docstring).

    ``model_state``: this rank's model state dict (``{fqn: tensor | DTensor}``); ``tied``: ``{alias: canonical}``
    (:func:`~meshkit.plugins.checkpoint.state.tied_aliases`), stored once under the canonical name;
    ``optimizer_states``: each optimizer's FQN-keyed state
    (:func:`~meshkit.plugins.checkpoint.state.flat_optimizer_state`), or None for a weights-only save;
    ``meta``: everything else (trainer state), written by rank 0 to ``meta.pt`` with the tied names.
    ``path`` must be the same on every rank. Save phases, for fault tests: ``partial_created``,
    ``shards_written``, ``meta_written``, ``manifest_written``, ``old_moved``, ``published``.

    Example::

        >>> save_sharded("ckpts/last.ckpt", get_model_state_dict(model), [flat_optimizer_state(model, opt)],
        ...              {"global_step": 10}, tied=tied_aliases(model))  # doctest: +SKIP
    """
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    path, rank, barrier = Path(path), rank_of(rank), barrier_of(barrier)
    partial, old = siblings(path)
    if rank == 0:
        repair(path)
        remove(partial)
        partial.mkdir(parents=True)
    barrier()
    _at("partial_created", path)
    aliases = dict(tied or {})
    state = {MODEL: without_aliases(model_state, aliases)}
    state.update({optimizer_key(i): s for i, s in enumerate(optimizer_states or [])})
    meta = {**meta, TIED_WEIGHTS: aliases}
    writer, hashed = hashing_writer(partial)  # each file hashed as DCP writes it: no read-back pass
    with torch_crc32_off():
        dcp.save(state, storage_writer=writer, no_dist=not dist.is_initialized())
    _at("shards_written", path)
    own = sorted(partial.glob(f"__{rank}_*"))  # DCP names a rank's shard files __RANK_i.distcp
    mine = {f.name: file_entry(f, rank, hashed) for f in own}
    gathered: list[Any] = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
    if rank == 0:
        with torch_crc32_off():
            hashed[META] = write_synced(partial / META, lambda f: torch.save(meta, f))
        _at("meta_written", path)
        files = {name: entry for part in gathered for name, entry in part.items()}
        for name in (".metadata", META):
            files[name] = file_entry(partial / name, 0, hashed)
        manifest = encode_manifest(files, world_size=len(gathered))
        write_synced(partial / MANIFEST, lambda f: f.write(manifest))
        fsync_dir(partial)
        _at("manifest_written", path)
        if path.exists() or path.is_symlink():
            os.rename(path, old)
        _at("old_moved", path)
        os.rename(partial, path)
        fsync_dir(path.parent)
        _at("published", path)
        remove(old)
        remove(sidecar(path))  # a single-file checkpoint's record, if one had this name before
    barrier()


# ---- load ---------------------------------------------------------------------------------------
def check_fits(model_state: dict[str, Any], checkpoint_dir: str | os.PathLike, *, strict: bool = True,
               job_keys: Collection[str] | None = None) -> None:
    """Raise :class:`CheckpointError` naming the first keys if the checkpoint's model entries do not fit
    ``model_state`` (``{fqn: tensor}``): shape mismatches always, missing / unexpected keys if ``strict``.
    ``job_keys``: every rank's keys together, when a rank holds only part of the model (pipeline stages);
    a checkpoint key is unexpected only if no rank holds it. Default: this rank's keys.

    Reads only the (safe) DCP metadata: no weight is touched.

    Example::

        >>> check_fits(get_model_state_dict(module), "ckpts/last.ckpt")  # doctest: +SKIP
    """
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    path = Path(checkpoint_dir)
    metadata = read_metadata(path)
    prefix = f"{MODEL}."
    saved = {k[len(prefix):]: v for k, v in metadata.state_dict_metadata.items() if k.startswith(prefix)}
    missing = [k for k in model_state if k not in saved]
    held = model_state if job_keys is None else job_keys
    unexpected = [k for k in saved if k not in held]
    shapes = [
        f"`{k}`: checkpoint {tuple(saved[k].size)}, model {tuple(v.shape)}"
        for k, v in model_state.items()
        if k in saved and isinstance(saved[k], TensorStorageMetadata) and isinstance(v, torch.Tensor)
        and tuple(saved[k].size) != tuple(v.shape)
    ]
    reasons = []
    if shapes:
        reasons.append(f"{len(shapes)} shape mismatch(es): " + "; ".join(shapes[:3]))
    if strict and missing:
        reasons.append(f"{len(missing)} key(s) missing from the checkpoint: {missing[:3]}")
    if strict and unexpected:
        reasons.append(f"{len(unexpected)} unexpected key(s) in the checkpoint: {unexpected[:3]}")
    if reasons:
        hint = "" if shapes else " Or set `LightningModule.strict_loading = False` to load the common keys."
        raise CheckpointError(
            f"checkpoint `{path}` does not fit the model: " + "; ".join(reasons)
            + ". Build the model with the configuration the checkpoint was saved with." + hint
        )


def gather_keys(model_state: dict[str, Any], group: Any = None) -> Optional[set[str]]:
    """Every pipeline stage's model keys together, gathered over ``group`` (this rank's ``pp`` group); None
    without one (no collective).

    Only pipeline stages hold different keys: FSDP and TP shard tensors, never keys, so without pp a rank's
    own keys are the job's. With pp the stages of one pp group hold the whole model between them, and every
    pp group holds the same keys whatever its dp/tp/cp coordinates, so the pp group's union equals the
    world's (it used to be gathered over the world on every resume).
    """
    if group is None:
        return None
    import torch.distributed as dist

    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, sorted(model_state), group=group)
    return {k for keys in gathered for k in keys}


def _dcp_load(state: dict[str, Any], path: Path, strict: bool) -> None:
    import torch.distributed.checkpoint as dcp

    with dcp_errors(path):
        dcp.load(state, storage_reader=SafeReader(path), planner=safe_load_planner(allow_partial_load=not strict))


def load_sharded(path: str | os.PathLike, module: nn.Module, optimizers: Iterable[Any] = (), *,
                 weights_only: bool = True, strict: bool = True, rank: Optional[int] = None,
                 world_size: Optional[int] = None, pp_group: Any = None,
                 allow_unverified: bool = False) -> dict[str, Any]:
    """Every rank: verify, check keys, then load a meshkit DCP folder into ``module`` (its FSDP/TP/pp layout:
    DCP reshards) and ``optimizers`` (FQN-keyed states); returns ``meta.pt`` (the trainer state).

    ``strict=False`` admits missing and unexpected keys (never a shape mismatch); ``pp_group``: this rank's
    pipeline group when stages hold different keys (:func:`gather_keys`). ``meta.pt`` is read with
    ``weights_only`` (default True: no arbitrary objects). A folder without ``meshkit.json`` is refused on every
    rank unless ``allow_unverified=True`` (then it loads unverified, with a warning).

    Example::

        >>> meta = load_sharded("ckpts/last.ckpt", model, [optimizer])  # doctest: +SKIP
    """
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_optimizer_state_dict,
    )

    path, rank = Path(path), rank_of(rank)
    check_published(path)
    verified = verify_checkpoint(path, rank=rank, world_size=world_of(world_size), allow_unverified=allow_unverified)
    if not verified and rank == 0:
        log.warning(f"meshkit: checkpoint `{path}` has no `{MANIFEST}`: loading it unverified (allow_unverified=True).")
    meta = _load_meta(path / META, weights_only)
    full = get_model_state_dict(module)
    load, fill = tied_load_plan(full, module, meta.get(TIED_WEIGHTS, {}))
    check_fits(load, path, strict=strict, job_keys=gather_keys(full, pp_group))
    _dcp_load({MODEL: load}, path, strict)
    for key, saved_as in fill.items():  # an untied model from a tied checkpoint: the head gets the embedding
        _dcp_load({MODEL: {saved_as: full[key]}}, path, strict)
    module.load_state_dict(full, strict=strict)
    opts = StateDictOptions(cpu_offload=True, flatten_optimizer_state_dict=True)
    for idx, optimizer in enumerate(optimizers):
        optimizer = getattr(optimizer, "_optimizer", optimizer)
        optim_state = {optimizer_key(idx): flat_optimizer_state(module, optimizer)}
        _dcp_load(optim_state, path, strict and not fill)  # a newly untied head has no saved optimizer state
        set_optimizer_state_dict(module, optimizer, optim_state_dict=optim_state[optimizer_key(idx)], options=opts)
    return meta


def _load_meta(file: Path, weights_only: bool) -> dict[str, Any]:
    import pickle

    try:
        return torch.load(file, map_location="cpu", weights_only=weights_only)
    except pickle.UnpicklingError as e:
        raise UnsafeCheckpointError(
            f"`{file}` holds an object outside torch's weights_only allowlist ({refusal(e)}): meshkit does not "
            f"unpickle it, since it could run code. {REGISTER} A checkpoint you wrote yourself and trust loads with "
            "`trainer.fit(..., weights_only=False)` or `fabric.load(path, state, weights_only=False)`."
        ) from None

