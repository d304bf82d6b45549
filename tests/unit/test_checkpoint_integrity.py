"""Integrity records without a read-back pass: files hashed as they are written, single files with a sidecar.

One process, tiny states; the truth for every hash is ``zlib.crc32`` of the bytes on disk.
"""

from __future__ import annotations

import io
import json
import zlib
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from meshkit.plugins import checkpointing as C
from meshkit.plugins.checkpointing import CheckpointError, consolidate_checkpoint, load_weights, verify_file
from tests.unit.test_bad_inputs import _STUB, _good


def _crc(file: Path) -> str:
    return f"{zlib.crc32(file.read_bytes()):08x}"


def _flip(file: Path) -> None:
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    file.write_bytes(bytes(data))


def test_save_hashes_every_file_as_written_without_reading_one_back(tmp_path, monkeypatch):
    def read_back(file):
        raise AssertionError(f"read back {file}")

    monkeypatch.setattr(C, "_crc32", read_back)
    ckpt = _good(tmp_path)
    monkeypatch.undo()
    files = json.loads((ckpt / C.MANIFEST).read_text())["files"]
    assert set(files) == {"__0_0.distcp", ".metadata", "meta.pt"}
    for name, entry in files.items():
        assert entry == {"rank": 0, "bytes": (ckpt / name).stat().st_size, "crc32": _crc(ckpt / name)}, name


def test_a_file_written_unhashed_or_with_a_seek_is_read_back(tmp_path):
    file = tmp_path / "f"
    with open(file, "wb") as raw, C._HashingStream(raw) as s:
        s.write(b"abcd")
        s.seek(1)
        s.write(b"X")
    assert s.digest is None  # the bytes passed through are not the file any more
    truth = {"rank": 3, "bytes": 4, "crc32": _crc(file)}
    assert file.read_bytes() == b"aXcd"
    assert C._file_entry(file, 3, {}) == truth  # no hash recorded: read back
    assert C._file_entry(file, 3, {"f": (5, "00000000")}) == truth  # recorded size disagrees: read back


def test_hashing_stream_hashes_what_torch_save_writes(tmp_path):
    state = {"w": torch.arange(1000, dtype=torch.float32), "lr": 0.1}
    nbytes, digest = C._write_synced(tmp_path / "s.pt", lambda f: torch.save(state, f))
    assert (nbytes, digest) == ((tmp_path / "s.pt").stat().st_size, _crc(tmp_path / "s.pt"))
    buf = io.BytesIO()
    torch.save(state, buf)
    assert buf.getvalue() == (tmp_path / "s.pt").read_bytes()  # the stream changed nothing on the way


def test_consolidated_file_has_a_sidecar_and_a_flipped_byte_is_caught(tmp_path):
    out = tmp_path / "model.pt"
    weights = consolidate_checkpoint(_good(tmp_path), out)
    side = json.loads((tmp_path / "model.pt.meshkit.json").read_text())
    assert side["hash"] == "crc32" and side["files"] == {
        "model.pt": {"rank": 0, "bytes": out.stat().st_size, "crc32": _crc(out)}}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["good.ckpt", "model.pt", "model.pt.meshkit.json"]
    loaded = load_weights(out)
    assert loaded.keys() == weights.keys() and all(torch.equal(loaded[k], weights[k]) for k in weights)
    _flip(out)
    with pytest.raises(CheckpointError, match=r"file `.*model.pt` is not usable: `model.pt` .* fails its crc32 "
                                              r"check: [0-9a-f]{8}, `model.pt.meshkit.json` says " + side["files"]
                                              ["model.pt"]["crc32"]):
        load_weights(out)
    (tmp_path / "model.pt.meshkit.json").unlink()
    verify_file(out)  # no record (torch.save, an older meshkit): unverified, as before


def test_single_file_checkpoint_has_a_sidecar_verified_on_load(tmp_path):
    stub = SimpleNamespace(**{**vars(_STUB), "_save_distributed_checkpoint": False})
    path = tmp_path / "last.ckpt"
    C.save_checkpoint(stub, {"state_dict": {"w": torch.ones(64)}, "global_step": 2}, path)
    assert (tmp_path / "last.ckpt.meshkit.json").is_file()
    got = C.load_checkpoint(stub, path, None, lambda p, weights_only: torch.load(p, weights_only=weights_only))
    assert got["global_step"] == 2
    _flip(path)
    with pytest.raises(CheckpointError, match=r"`last.ckpt` \(written by rank 0\) (fails its crc32|has \d+ bytes)"):
        C.load_checkpoint(stub, path, None, lambda *a, **k: pytest.fail("loaded a corrupt file"))


@pytest.mark.parametrize("published", [False, True], ids=["before_rename", "between_renames"])
def test_interrupted_file_publish_is_repaired(tmp_path, published):
    out = tmp_path / "model.pt"
    C._publish_file(out, lambda f: f.write(b"old"))
    partial = tmp_path / ".model.pt.partial"
    C._write_synced(partial, lambda f: f.write(b"new!"))
    C._write_synced(C._sidecar(partial), lambda f: f.write(C._manifest(
        {"model.pt": {"rank": 0, "bytes": 4, "crc32": f"{zlib.crc32(b'new!'):08x}"}})))
    if published:  # the crash came after the file's rename, before the sidecar's
        partial.rename(out)
    C._repair_file(out)
    assert out.read_bytes() == (b"new!" if published else b"old")
    verify_file(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.pt", "model.pt.meshkit.json"]


def test_job_keys_need_no_collective_without_pp():
    state = {"a": torch.ones(1)}
    assert C._job_keys(state, None) is None
    assert C._job_keys(state, SimpleNamespace(pp_enabled=False)) is None  # no process group exists here
