"""What a multi-process run prints: an error printed once (known-harmless library noise: ``meshkit.quiet``).

- :func:`report_once`: a configuration error that every rank raises alike is printed in full by the first rank
  of the node to raise it; the others print one line naming it (the exception still propagates on every rank).

Example::

    >>> import uuid
    >>> try:
    ...     raise ValueError("`tp=3` does not divide 4")
    ... except ValueError as e:
    ...     report_once(e, job=f"127.0.0.1:29500 {uuid.uuid4()}")  # the first to raise it: printed in full
    True
"""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile
import time
from types import TracebackType
from typing import Optional

__all__ = ["report_once"]

STALE_S = 30.0
"""The ranks of one job reach their configuration checks within seconds of each other; a marker older than this is
an earlier job's (a rerun on the same fixed port), so the rerun's first rank prints in full again."""


def report_once(exc: BaseException, job: str) -> bool:
    """Whether this process is the first on this machine to raise ``exc``'s message in ``job`` (e.g. the rendezvous
    ``address:port``). If not, an uncaught ``exc`` prints one line, not its traceback (the first one printed it in
    full): the ranks of one job raise the same configuration error alike, and 4-8 copies of one traceback hid
    each other. Whoever catches ``exc`` still gets it unchanged; the exit status is unchanged."""
    key = hashlib.sha1(f"{job}\0{type(exc).__name__}\0{exc}".encode()).hexdigest()[:16]
    marker = os.path.join(tempfile.gettempdir(), f"meshkit-error-{os.getuid() if hasattr(os, 'getuid') else 0}-{key}")
    try:
        if os.path.exists(marker) and time.time() - os.path.getmtime(marker) > STALE_S:
            os.remove(marker)  # an earlier job's (same address, port and error): this job prints its own
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        pass
    except OSError:  # no writable temp dir: print in full, as Python would
        return True
    previous = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException, tb: Optional[TracebackType]) -> None:
        if value is exc:
            rank = os.environ.get("RANK", os.environ.get("LOCAL_RANK", "?"))
            print(f"rank {rank}: {type(exc).__name__} (the same error another rank of this job printed in full): "
                  f"{str(exc).splitlines()[0][:160]}", file=sys.stderr)
        else:
            previous(kind, value, tb)

    sys.excepthook = hook
    return False
