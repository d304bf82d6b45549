"""Ground floor: known-harmless library warnings meshkit hides where the library raises them, for every meshkit
entry into a Lightning run (the strategies, MFUMonitor, Doctor, TritonKernelReport) alike.

Each filter matches one message from one module only, so the same deprecation raised by a user's own code still
warns. Imports nothing of meshkit.

Example::

    >>> quiet_lightning_pytree()  # idempotent: warnings.filterwarnings replaces an identical filter
"""

from __future__ import annotations

import warnings

__all__ = ["quiet_lightning_pytree"]


def quiet_lightning_pytree() -> None:
    """Hide one known-harmless warning, only where Lightning raises it: Lightning 2.6's
    ``lightning/pytorch/utilities/_pytree.py`` builds torch's deprecated ``LeafSpec()`` (torch >= 2.10: "`isinstance(
    treespec, LeafSpec)` is deprecated", a FutureWarning) for every batch it flattens, printed once per process of
    every run (4-8 lines on 4 ranks, one in a one-device run). It is Lightning's to fix and changes nothing; the
    filter matches that message from that module only, so a user's own use of LeafSpec still warns."""
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
                            category=FutureWarning, module=r"lightning\.pytorch\.utilities\._pytree")
