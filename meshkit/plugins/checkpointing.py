"""Sharded checkpoints: consolidate a DCP checkpoint folder into one ordinary state-dict file.

The strategy saves through DCP (one shard file per rank plus ``meta.pt``); DCP reshards on load,
so a checkpoint saved at one layout resumes at another. For export, ``consolidate_checkpoint``
(or ``meshkit consolidate CKPT_DIR OUT.pt``) writes the model's full tensors, keyed by parameter
name, to a file ``torch.load(..., weights_only=True)`` reads. It needs no process group.

Example::

    >>> from meshkit.plugins.checkpointing import consolidate_checkpoint
    >>> consolidate_checkpoint("ckpts/last.ckpt", "model.pt", strip_prefix="model.")  # doctest: +SKIP
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

__all__ = ["consolidate_checkpoint", "configure_parser", "run_cli"]


def consolidate_checkpoint(
    checkpoint_dir: str | os.PathLike, output: str | os.PathLike | None = None, *, strip_prefix: str = ""
) -> dict[str, torch.Tensor]:
    """Read a sharded checkpoint's model weights into one ``{name: tensor}`` dict; save it if ``output``.

    ``strip_prefix`` removes a leading module name (``"model."`` for a LightningModule whose network
    lives in ``self.model``) so the file loads straight into the bare network.
    """
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    path = Path(checkpoint_dir)
    if not (path / ".metadata").is_file():
        raise ValueError(
            f"consolidate_checkpoint: `{path}` is not a sharded (DCP) checkpoint folder: it has no `.metadata` file. "
            "Pass the folder `trainer.save_checkpoint` or ModelCheckpoint wrote."
        )
    with tempfile.TemporaryDirectory() as tmp:
        full = Path(tmp) / "full.pt"
        dcp_to_torch_save(path, full)
        state = torch.load(full, map_location="cpu", weights_only=True)
    model_state = state.get("state_dict")
    if not isinstance(model_state, dict):
        raise ValueError(f"consolidate_checkpoint: `{path}` holds no `state_dict` entry; keys: {sorted(state)}.")
    weights = {
        (k[len(strip_prefix):] if strip_prefix and k.startswith(strip_prefix) else k): v.detach().clone()
        for k, v in model_state.items()
        if isinstance(v, torch.Tensor)
    }
    if output is not None:
        torch.save(weights, output)
    return weights


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="sharded checkpoint folder (with a .metadata file)")
    parser.add_argument("output", help="file to write: {parameter name: tensor}, loadable with weights_only=True")
    parser.add_argument("--strip-prefix", default="", help="remove this prefix from every name, e.g. 'model.'")


def run_cli(args: Any) -> int:
    weights = consolidate_checkpoint(args.checkpoint, args.output, strip_prefix=args.strip_prefix)
    numel = sum(t.numel() for t in weights.values())
    print(f"wrote {len(weights)} tensors ({numel:,} elements) to {args.output}")
    return 0
