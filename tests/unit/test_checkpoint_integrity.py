"""Integrity records without a read-back pass: files hashed as they are written, single files with a sidecar.

One process, tiny states; the truth for every hash is ``zlib.crc32`` of the bytes on disk.
"""

from __future__ import annotations

import io
import json
import zlib
from pathlib import Path
import pytest
import torch
from torch import nn

from meshkit.plugins.checkpoint import CheckpointError, consolidate_checkpoint, load_weights, verify_file
from meshkit.plugins.checkpoint import atomic as A
from meshkit.plugins.checkpoint import manifest as M
from meshkit.plugins.checkpoint.api import load_checkpoint, save_checkpoint
from meshkit.plugins.checkpoint.sharded import gather_keys
from tests.unit.test_bad_inputs import _good


def _crc(file: Path) -> str:
    return f"{zlib.crc32(file.read_bytes()):08x}"


def _flip(file: Path) -> None:
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    file.write_bytes(bytes(data))


def test_save_hashes_every_file_as_written_without_reading_one_back(tmp_path, monkeypatch):
    def read_back(file):
        raise AssertionError(f"read back {file}")

    monkeypatch.setattr(M, "crc32", read_back)  # every read-back: a manifest entry's, a synced file's
    monkeypatch.setattr(A, "crc32", read_back)
    ckpt = _good(tmp_path)
    monkeypatch.undo()
    files = json.loads((ckpt / M.MANIFEST).read_text())["files"]
    assert set(files) == {"__0_0.distcp", ".metadata", "meta.pt"}
    for name, entry in files.items():
        assert entry == {"rank": 0, "bytes": (ckpt / name).stat().st_size, "crc32": _crc(ckpt / name)}, name


def test_a_file_written_unhashed_or_with_a_seek_is_read_back(tmp_path):
    file = tmp_path / "f"
    with open(file, "wb") as raw, M.HashingStream(raw) as s:
        s.write(b"abcd")
        s.seek(1)
        s.write(b"X")
    assert s.digest is None  # the bytes passed through are not the file any more
    truth = {"rank": 3, "bytes": 4, "crc32": _crc(file)}
    assert file.read_bytes() == b"aXcd"
    assert M.file_entry(file, 3, {}) == truth  # no hash recorded: read back
    assert M.file_entry(file, 3, {"f": (5, "00000000")}) == truth  # recorded size disagrees: read back


def test_hashing_stream_hashes_what_torch_save_writes(tmp_path):
    state = {"w": torch.arange(1000, dtype=torch.float32), "lr": 0.1}
    nbytes, digest = A.write_synced(tmp_path / "s.pt", lambda f: torch.save(state, f))
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
    with pytest.raises(CheckpointError, match=r"cannot be verified: it has no `model.pt.meshkit.json`"):
        verify_file(out)  # no record (torch.save, a lost sidecar): refused, unless the user opts in
    assert verify_file(out, allow_unverified=True) is False


def test_a_lost_manifest_is_refused_unless_the_user_opts_in_and_nothing_unverified_comes_out_certified(
        tmp_path, caplog):
    # Issue 27 item 5: manifest deleted + one tensor byte flipped resumed with a weight of 2.45e37, and
    # consolidate wrote a fresh sidecar, so load_weights called the file verified.
    ckpt = _good(tmp_path)
    saved = consolidate_checkpoint(ckpt)
    (ckpt / M.MANIFEST).unlink()
    net = nn.Module()
    net.layers = nn.ModuleList(nn.Module() for _ in range(2))
    for layer in net.layers:
        layer.w = nn.Parameter(torch.zeros(4, 4))
    for call in (lambda: load_checkpoint(ckpt, net), lambda: consolidate_checkpoint(ckpt, tmp_path / "o.pt")):
        with pytest.raises(CheckpointError, match=r"has no `meshkit.json`, so none of its files can be checked"):
            call()
    assert all(torch.equal(p, torch.zeros(4, 4)) for p in net.parameters()) and not (tmp_path / "o.pt").exists()
    # the opt-in, by name: the intact folder loads, with a warning, and its export is marked unverified
    with caplog.at_level("WARNING"):
        meta = load_checkpoint(ckpt, net, allow_unverified=True)
    assert meta["global_step"] == 3 and "loading it unverified" in caplog.text
    assert torch.equal(net.layers[1].w.detach(), saved["layers.1.w"])
    out = tmp_path / "model.pt"
    consolidate_checkpoint(ckpt, out, allow_unverified=True)
    assert json.loads(M.sidecar(out).read_text())[M.UNVERIFIED] == f"`{ckpt}` had no manifest"
    with pytest.raises(CheckpointError, match=r"consolidated from an unverified checkpoint"):
        load_weights(out)
    got = load_weights(out, allow_unverified=True)
    assert all(torch.equal(got[k], saved[k]) for k in saved)
    consolidate_checkpoint(_good(tmp_path, "other.ckpt"), out)  # from a verified folder: certified again
    assert M.UNVERIFIED not in json.loads(M.sidecar(out).read_text()) and verify_file(out) is True


def test_single_file_save_creates_its_folder(tmp_path):
    # Issue 27 item 7: save_distributed_checkpoint=False with ModelCheckpoint's folder not created yet raised a
    # raw FileNotFoundError at the first save (Lightning's own writer makes the folder).
    path = tmp_path / "checkpoints" / "run-1" / "epoch=0-step=2.ckpt"
    save_checkpoint(path, {"w": torch.ones(3)}, None, {"global_step": 2}, sharded=False)
    net = nn.Module()
    net.w = nn.Parameter(torch.zeros(3))
    assert load_checkpoint(path, net)["global_step"] == 2 and torch.equal(net.w.detach(), torch.ones(3))
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name, path.name + ".meshkit.json"]


def test_single_file_checkpoint_has_a_sidecar_verified_on_load(tmp_path):
    path = tmp_path / "last.ckpt"
    save_checkpoint(path, {"w": torch.ones(64)}, None, {"global_step": 2}, sharded=False)
    assert (tmp_path / "last.ckpt.meshkit.json").is_file()
    net = nn.Module()
    net.w = nn.Parameter(torch.zeros(64))
    got = load_checkpoint(path, net)
    assert got["global_step"] == 2 and torch.equal(net.w.detach(), torch.ones(64))
    _flip(path)
    with pytest.raises(CheckpointError, match=r"`last.ckpt` \(written by rank 0\) (fails its crc32|has \d+ bytes)"):
        load_checkpoint(path, None)  # no module: a load that got past the check would fail otherwise


@pytest.mark.parametrize("published", [False, True], ids=["before_rename", "between_renames"])
def test_interrupted_file_publish_is_repaired(tmp_path, published):
    out = tmp_path / "model.pt"
    A.publish_file(out, lambda f: f.write(b"old"))
    partial = tmp_path / ".model.pt.partial"
    A.write_synced(partial, lambda f: f.write(b"new!"))
    A.write_synced(M.sidecar(partial), lambda f: f.write(M.encode_manifest(
        {"model.pt": {"rank": 0, "bytes": 4, "crc32": f"{zlib.crc32(b'new!'):08x}"}})))
    if published:  # the crash came after the file's rename, before the sidecar's
        partial.rename(out)
    A.repair_file(out)
    assert out.read_bytes() == (b"new!" if published else b"old")
    verify_file(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.pt", "model.pt.meshkit.json"]


def test_job_keys_need_no_collective_without_pp():
    assert gather_keys({"a": torch.ones(1)}, None) is None  # no process group exists here
