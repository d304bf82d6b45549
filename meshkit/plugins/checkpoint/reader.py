"""Reading DCP checkpoints without running code from them: a restricted reader and load planners.

torch DCP's ``FileSystemReader`` reads ``.metadata`` with plain ``pickle.load`` and its default load
planner ``torch.load``s every non-tensor entry of a shard with ``weights_only=False``: a crafted
checkpoint runs code on every rank that resumes from it. meshkit reads checkpoints through
:class:`SafeReader` (``.metadata`` through :class:`MetadataUnpickler`, which admits only DCP's
metadata classes, torch sizes / dtypes / layouts and plain containers and scalars) and
:func:`safe_load_planner` (non-tensor entries through ``torch.load(weights_only=True)``).
Anything else raises :class:`UnsafeCheckpointError`.

Example::

    >>> import torch.distributed.checkpoint as dcp
    >>> from meshkit.plugins.checkpoint import SafeReader, safe_load_planner
    >>> dcp.load(state, storage_reader=SafeReader("ckpts/last.ckpt"), planner=safe_load_planner())  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import io
import pickle
from typing import Any, Iterator

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from meshkit.plugins.checkpoint.errors import CheckpointError, UnsafeCheckpointError, refusal

__all__ = ["MetadataUnpickler", "SafeReader", "safe_load_planner", "read_metadata", "read_all", "dcp_errors"]

_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "StorageMeta", "MetadataIndex", "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.distributed.checkpoint._extension": {"StreamTransformExtension"},
    "torch.serialization": {"_get_layout"},  # a layout by name, e.g. "torch.strided"
    "torch": {"Size"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "tuple", "list", "dict", "slice"},
    "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"},
}


class MetadataUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that admits only DCP metadata classes, torch sizes, dtypes and layouts,
    and plain containers; any other global raises :class:`UnsafeCheckpointError`."""

    def find_class(self, module: str, name: str) -> Any:
        if name in _METADATA_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout)):
            return getattr(torch, name)
        raise UnsafeCheckpointError(
            f"refused to unpickle `{module}.{name}`: a DCP `.metadata` file holds only DCP metadata classes, "
            "so this checkpoint was crafted or is not a DCP checkpoint. Do not load it."
        )


def read_metadata(path: Any) -> Metadata:
    """The DCP ``Metadata`` of the checkpoint folder ``path``, read through :class:`MetadataUnpickler`."""
    from pathlib import Path

    file = Path(path) / ".metadata"
    try:
        with open(file, "rb") as f:
            metadata = MetadataUnpickler(f).load()
    except UnsafeCheckpointError as e:
        raise UnsafeCheckpointError(f"{file}: {e}") from None
    except (pickle.UnpicklingError, EOFError, AttributeError, ImportError, TypeError, ValueError) as e:
        raise UnsafeCheckpointError(f"{file}: not a readable DCP metadata file ({type(e).__name__}: {e}).") from None
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpointError(f"{file}: holds a {type(metadata).__name__}, not DCP `Metadata`.")
    return metadata


class SafeReader(FileSystemReader):
    """DCP's ``FileSystemReader`` with ``.metadata`` read through :class:`MetadataUnpickler`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_metadata(self.path)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _load_bytes_safely(read_item: Any, value: io.BytesIO) -> Any:
    try:
        return torch.load(value, weights_only=True)
    except pickle.UnpicklingError as e:
        raise UnsafeCheckpointError(
            f"refused the non-tensor entry `{read_item.storage_index.fqn}`: it is not plain data ({refusal(e)}). "
            "Do not load this checkpoint."
        ) from None


class _SafeBytes:
    """Mixin: ``load_bytes`` with ``weights_only=True`` (torch's planners use ``weights_only=False``)."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        obj = _load_bytes_safely(read_item, value)
        super().load_bytes(read_item, io.BytesIO(_repickle(obj)))  # type: ignore[misc]


def _repickle(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return buf.getvalue()


class _SafeLoadPlanner(_SafeBytes, DefaultLoadPlanner):
    pass


class _SafeEmptyLoadPlanner(_SafeBytes, _EmptyStateDictLoadPlanner):
    # _EmptyStateDictLoadPlanner (private) rebuilds the state dict from the metadata; checked on torch 2.6-2.13.
    pass


def safe_load_planner(*, allow_partial_load: bool = False, from_metadata: bool = False) -> DefaultLoadPlanner:
    """A DCP load planner whose non-tensor entries are read with ``torch.load(weights_only=True)``.

    ``from_metadata``: build the state dict from the checkpoint itself (export, no model needed).
    """
    if from_metadata:
        return _SafeEmptyLoadPlanner()
    return _SafeLoadPlanner(allow_partial_load=allow_partial_load)


def read_all(path: Any) -> dict[str, Any]:
    """Every entry of the DCP checkpoint at ``path`` as a nested dict, in one process, without unpickling code.

    What torch's ``dcp_to_torch_save`` reads, through :class:`SafeReader` and a safe planner.
    """
    # _load_state_dict is private (dcp_to_torch_save calls it the same way); checked on torch 2.6-2.13.
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    read_metadata(path)  # a refused pickle raises here, not wrapped in DCP's CheckpointException
    state: dict[str, Any] = {}
    planner = safe_load_planner(from_metadata=True)
    _load_state_dict(state, storage_reader=SafeReader(path), planner=planner, no_dist=True)
    return state


@contextlib.contextmanager
def dcp_errors(path: Any) -> Iterator[None]:
    """Turn DCP's ``CheckpointException`` (a BaseException listing ranks, cause buried) into a
    :class:`CheckpointError` naming the checkpoint, the failing ranks and the first cause."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as e:
        failures = e.failures
        rank = min(failures)
        cause = failures[rank][0]
        kind = UnsafeCheckpointError if isinstance(cause, UnsafeCheckpointError) else CheckpointError
        raise kind(
            f"checkpoint `{path}`: loading failed on rank(s) {sorted(failures)}; rank {rank}: "
            f"{type(cause).__name__}: {cause}"
        ) from None
