"""``meshkit consolidate``: a sharded checkpoint's model weights as one ``{name: tensor}`` file.

The folder is verified against its manifest and read in one process without unpickling code; the output
gets a sidecar (``OUT.meshkit.json``) and loads with ``torch.load(..., weights_only=True)`` or, verified,
with :func:`~meshkit.plugins.checkpoint.single.load_weights`. No process group is needed.

Example::

    >>> from meshkit.plugins.checkpoint import consolidate_checkpoint
    >>> consolidate_checkpoint("ckpts/last.ckpt", "model.pt", strip_prefix="model.")  # doctest: +SKIP
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import torch

from meshkit.plugins.checkpoint.atomic import check_published, publish_file
from meshkit.plugins.checkpoint.manifest import UNVERIFIED, verify_checkpoint
from meshkit.plugins.checkpoint.reader import dcp_errors, read_all
from meshkit.plugins.checkpoint.state import MODEL

__all__ = ["consolidate_checkpoint", "configure_parser", "run_cli"]


def consolidate_checkpoint(
    checkpoint_dir: str | os.PathLike, output: str | os.PathLike | None = None, *, strip_prefix: str = "",
    allow_unverified: bool = False,
) -> dict[str, torch.Tensor]:
    """Read a sharded checkpoint's model weights into one ``{name: tensor}`` dict; save it if ``output``.

    The folder is verified against its manifest and read without unpickling code (as on resume).
    ``strip_prefix`` removes a leading module name (``"model."`` for a LightningModule whose network
    lives in ``self.model``) so the file loads straight into the bare network. A folder without its
    manifest is refused unless ``allow_unverified=True``; the output then says so in its sidecar, and
    loading it (:func:`~meshkit.plugins.checkpoint.single.load_weights`) needs the same opt-in: nothing
    unverified comes out certified.

    Example::

        >>> weights = consolidate_checkpoint("ckpts/last.ckpt", strip_prefix="model.")  # doctest: +SKIP
    """
    path = Path(checkpoint_dir)
    check_published(path)
    if not (path / ".metadata").is_file():
        why = "does not exist" if not path.exists() else "has no `.metadata` file"
        raise ValueError(
            f"consolidate_checkpoint: `{path}` is not a sharded (DCP) checkpoint folder: it {why}. "
            "Pass the folder `trainer.save_checkpoint` or ModelCheckpoint wrote."
        )
    verified = verify_checkpoint(path, allow_unverified=allow_unverified)
    with dcp_errors(path):
        state = read_all(path)
    model_state = state.get(MODEL)
    if not isinstance(model_state, dict):
        raise ValueError(f"consolidate_checkpoint: `{path}` holds no `{MODEL}` entry; keys: {sorted(state)}.")
    weights = {
        (k[len(strip_prefix):] if strip_prefix and k.startswith(strip_prefix) else k): v.detach().clone()
        for k, v in model_state.items()
        if isinstance(v, torch.Tensor)
    }
    if output is not None:  # with its sidecar OUTPUT.meshkit.json: load it back with `load_weights`
        source = {} if verified else {UNVERIFIED: f"`{path}` had no manifest"}
        publish_file(Path(output), lambda f: torch.save(weights, f), **source)
    return weights


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="sharded checkpoint folder (with a .metadata file)")
    parser.add_argument("output", help="file to write: {parameter name: tensor}, loadable with weights_only=True")
    parser.add_argument("--strip-prefix", default="", help="remove this prefix from every name, e.g. 'model.'")
    parser.add_argument("--allow-unverified", action="store_true",
                        help="read a folder without its manifest (meshkit.json); the output's sidecar says so")


def run_cli(args: Any) -> int:
    """``meshkit consolidate``; a bad checkpoint raises CheckpointError (a ValueError): cli.py prints it, exit 2."""
    weights = consolidate_checkpoint(args.checkpoint, args.output, strip_prefix=args.strip_prefix,
                                     allow_unverified=args.allow_unverified)
    numel = sum(t.numel() for t in weights.values())
    print(f"wrote {len(weights)} tensors ({numel:,} elements) to {args.output}")
    return 0
