"""Checkpoints for every layout: atomic, verified DCP saves, safe and strict loads, and consolidation.

Plain functions of paths, state dicts, ranks and process groups; a front door (the Trainer's strategy,
a Fabric strategy) gathers the states and calls :func:`save_checkpoint` / :func:`load_checkpoint`.

- :mod:`~meshkit.plugins.checkpoint.manifest`: the integrity record (``meshkit.json``, a file's
  ``NAME.meshkit.json`` sidecar), the hash (CRC-32, computed as files are written), verification.
- :mod:`~meshkit.plugins.checkpoint.atomic`: publishing a file or folder under its name only when complete,
  and repairing a publish a crash interrupted.
- :mod:`~meshkit.plugins.checkpoint.reader`: reading DCP checkpoints without running code from them.
- :mod:`~meshkit.plugins.checkpoint.state`: what a checkpoint holds under which name (FQN-keyed optimizer
  states, tied weights once).
- :mod:`~meshkit.plugins.checkpoint.sharded`: the sharded (DCP) save and load (resharding on load).
- :mod:`~meshkit.plugins.checkpoint.single`: single-file checkpoints, and exported weights.
- :mod:`~meshkit.plugins.checkpoint.consolidate`: ``meshkit consolidate``.
- :mod:`~meshkit.plugins.checkpoint.api`: the two entry points, either format.

Every failure is one :class:`CheckpointError` (a ``ValueError``) on every rank naming the file, its rank
and the reason. docs/checkpoints.md tells the whole story.

Example::

    >>> from meshkit.plugins.checkpoint import consolidate_checkpoint
    >>> consolidate_checkpoint("ckpts/last.ckpt", "model.pt", strip_prefix="model.")  # doctest: +SKIP
"""

from __future__ import annotations

from meshkit.plugins.checkpoint.api import load_checkpoint, save_checkpoint
from meshkit.plugins.checkpoint.consolidate import consolidate_checkpoint
from meshkit.plugins.checkpoint.errors import CheckpointError, UnsafeCheckpointError
from meshkit.plugins.checkpoint.manifest import HASH, MANIFEST, SIDECAR, verify_checkpoint, verify_file
from meshkit.plugins.checkpoint.reader import SafeReader, read_all, read_metadata, safe_load_planner
from meshkit.plugins.checkpoint.sharded import check_fits, load_sharded, save_sharded
from meshkit.plugins.checkpoint.single import load_file, load_weights, save_file
from meshkit.plugins.checkpoint.state import TIED_WEIGHTS, flat_optimizer_state, tied_aliases

__all__ = [
    "save_checkpoint",
    "load_checkpoint",
    "save_sharded",
    "load_sharded",
    "save_file",
    "load_file",
    "load_weights",
    "consolidate_checkpoint",
    "verify_checkpoint",
    "verify_file",
    "check_fits",
    "flat_optimizer_state",
    "tied_aliases",
    "CheckpointError",
    "UnsafeCheckpointError",
    "MANIFEST",
    "HASH",
    "SIDECAR",
    "TIED_WEIGHTS",
    "SafeReader",
    "safe_load_planner",
    "read_metadata",
    "read_all",
]
