"""Atomic publishing: a file or folder appears under its name complete, or not at all.

A single file (:func:`publish_file`) is written to ``.NAME.partial`` and its sidecar, each fsynced, then
both renamed into place; a folder (the sharded save in :mod:`~meshkit.plugins.checkpoint.sharded`) is
written to ``.NAME.partial`` and renamed over ``NAME`` with the previous copy parked at ``.NAME.old``
(:func:`siblings`). A crash between the renames is finished or undone by the next load or save
(:func:`repair`, :func:`repair_file`): the newest complete copy wins.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Callable

from meshkit.plugins.checkpoint.errors import CheckpointError
from meshkit.plugins.checkpoint.manifest import HASH, MANIFEST, HashingStream, crc32, encode_manifest, sidecar

__all__ = [
    "publish_file", "repair_file", "write_synced", "fsync_dir", "remove", "siblings", "published_name",
    "check_published", "is_complete", "repair",
]


def publish_file(out: Path, write: Callable[[Any], None], make_room: Callable[[], None] = lambda: None,
                 **fields: Any) -> None:
    """Write ``out`` and its sidecar atomically: temp file + fsync, temp sidecar + fsync, rename, rename.

    A crash before the first rename leaves the previous ``out`` and sidecar; after it, the temp sidecar
    is renamed into place by the next :func:`repair_file`. ``make_room`` runs just before the renames;
    ``fields`` go into the sidecar (e.g. :data:`~meshkit.plugins.checkpoint.manifest.UNVERIFIED`).
    """
    repair_file(out)
    partial = out.with_name(f".{out.name}.partial")
    nbytes, digest = write_synced(partial, write)
    record = encode_manifest({out.name: {"rank": 0, "bytes": nbytes, HASH: digest}}, **fields)
    write_synced(sidecar(partial), lambda f: f.write(record))
    make_room()
    os.replace(partial, out)
    os.replace(sidecar(partial), sidecar(out))
    fsync_dir(out.parent)


def repair_file(out: Path) -> None:
    """Finish or undo a :func:`publish_file` a crash interrupted (the temp file's presence tells which)."""
    partial = out.with_name(f".{out.name}.partial")
    if not sidecar(partial).is_file():
        return
    if partial.is_file():  # not published: the previous file and sidecar stand
        remove(partial)
        remove(sidecar(partial))
    else:  # the file was renamed into place, its sidecar not yet
        os.replace(sidecar(partial), sidecar(out))
        fsync_dir(out.parent)


def fsync_dir(path: Path) -> None:
    """fsync the folder ``path``: its entries (a rename, a new file) survive a power loss."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_synced(file: Path, write: Callable[[Any], None]) -> tuple[int, str]:
    """Write ``file`` through ``write(stream)``, fsync it; ``(bytes, crc32)`` of what was written (no read-back)."""
    with open(file, "wb") as raw, HashingStream(raw) as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    return f.nbytes, f.digest if f.digest is not None else crc32(file)


def remove(path: Path) -> None:
    """Remove ``path`` (a folder, a file or a link) if it exists."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def siblings(path: Path) -> tuple[Path, Path]:
    """``(.NAME.partial, .NAME.old)``: where a save is written, and where the previous one waits during publish."""
    return path.with_name(f".{path.name}.partial"), path.with_name(f".{path.name}.old")


def published_name(path: Path) -> Path | None:
    """The name a temporary sibling (:func:`siblings`: ``.NAME.partial``, ``.NAME.old``) stands in for, else None."""
    for suffix in (".partial", ".old"):
        if path.name.startswith(".") and path.name.endswith(suffix) and len(path.name) > len(suffix) + 1:
            return path.with_name(path.name[1:-len(suffix)])
    return None


def check_published(path: Path, given: Any = None) -> None:
    """Refuse meshkit's temporary folder or file of a save (``.NAME.partial``: unfinished or not yet published;
    ``.NAME.old``: the previous copy during a publish): only ``NAME`` is a checkpoint (an interrupted publish
    is finished when ``NAME`` is loaded or saved)."""
    name = published_name(path)
    if name is None:
        return
    what = "unfinished copy" if path.name.endswith(".partial") else "previous copy, kept only while it publishes"
    raise CheckpointError(
        f"`{given if given is not None else path}` is meshkit's temporary {what} of a save to `{name.name}`, not a "
        f"checkpoint. Pass `{name}` (an interrupted save is finished or undone when it is loaded), or an earlier "
        "checkpoint."
    )


def is_complete(path: Path) -> bool:
    """Whether the folder ``path`` holds a manifest (written last: the commit marker)."""
    return path.is_dir() and (path / MANIFEST).is_file()


def repair(path: Path) -> None:
    """Rank 0: finish a publish a crash interrupted between its two renames (the newest complete copy wins)."""
    partial, old = siblings(path)
    if not path.exists() and not path.is_symlink():
        for candidate in (partial, old):
            if is_complete(candidate) or (candidate is old and candidate.exists()):
                os.rename(candidate, path)
                fsync_dir(path.parent)
                break
    if old.exists() and path.exists():
        remove(old)
