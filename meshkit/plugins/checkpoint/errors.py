"""The two errors every checkpoint function raises (both ``ValueError``: a bad checkpoint is a bad input)."""

from __future__ import annotations

import re

__all__ = ["CheckpointError", "UnsafeCheckpointError", "refusal"]


class CheckpointError(ValueError):
    """A checkpoint is incomplete, corrupt, unsafe, or does not fit the model (a bad input: ``meshkit`` verbs
    print it on one line and exit 2)."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint holds an object meshkit refuses to unpickle (it could run code)."""


REGISTER = (
    "If the object is yours (e.g. a callback's state), allow its class with "
    "`torch.serialization.add_safe_globals([TheClass])` before loading; never switch the check off "
    "(`weights_only=False`) for a file you did not write."
)
"""The one safe fix every refusal of a pickled object names."""


def refusal(error: Exception) -> str:
    """What torch's ``weights_only`` unpickler refused, without its advice to re-run with ``weights_only=False``
    (advice that runs the payload of a crafted file): e.g. ``unsupported GLOBAL posix.system``."""
    text = str(error)
    found = re.search(r"(Trying to load unsupported GLOBAL [^\n]*|Unsupported global: [^\n]*|"
                      r"WeightsUnpickler error: [^\n]*)", text)
    if found:
        return found.group(1).rstrip(". ").replace("Trying to load u", "u")
    first = text.strip().splitlines()[0] if text.strip() else type(error).__name__
    return "weights_only refused it" if "weights_only" in first else first
