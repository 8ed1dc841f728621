"""Checkpoint checksums: made while the files are written, checked before they are read,
and older (sha256) manifests still accepted."""

import hashlib
import io
import json
import os
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn

from fullshard import checkpoint as ckpt
from fullshard.checkpoint import checksums
from fullshard.checkpoint.hashing_writer import (HashingFileSystem, HashingWriter,
                                                 file_sizes, unrecorded)
from fullshard.checkpoint.io import _gather_checksums


def _model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(3, 32)).sum().backward()
    opt.step()
    return model, opt


def _manifest(path):
    with open(os.path.join(path, "fullshard.json")) as f:
        return json.load(f)


def _shard(path):
    return sorted(p for p in os.listdir(path) if p.endswith(".distcp"))[0]


def test_files_are_hashed_while_dcp_writes_them(tmp_path):
    model, opt = _model()
    writer = HashingWriter(str(tmp_path), checksums.SHA256)
    dcp.save({"model": model.state_dict(), "optim": opt.state_dict()},
             storage_writer=writer, no_dist=True)
    entries = writer.entries()
    # every file DCP wrote, .metadata too (written under a temporary name, then renamed)
    assert sorted(entries) == sorted(os.listdir(tmp_path))
    assert ".metadata" in entries and _shard(str(tmp_path)) in entries
    assert unrecorded(file_sizes(str(tmp_path)), entries) == []
    for name, entry in entries.items():
        assert entry == checksums.file_entry(tmp_path / name, checksums.SHA256), name


def test_a_stream_that_was_sought_or_misused_vouches_for_nothing(tmp_path):
    fs = HashingFileSystem(checksums.SHA256)
    with fs.create_stream(tmp_path / "plain", "wb") as f:
        f.write(b"abc")
        f.write(memoryview(torch.arange(4, dtype=torch.float32).numpy()))  # not bytes
    assert fs.entries()["plain"] == checksums.file_entry(tmp_path / "plain", checksums.SHA256)
    with fs.create_stream(tmp_path / "sought", "wb") as f:
        f.write(b"abcdef")
        f.seek(1)
        f.write(b"X")  # the digest of what was written is not the file's any more
    with fs.create_stream(tmp_path / "other_method", "wb") as f:
        f.writelines([b"a", b"b"])  # bypasses write()
    with pytest.raises(RuntimeError):
        with fs.create_stream(tmp_path / "failed", "wb") as f:
            f.write(b"partial")
            raise RuntimeError("the writer died")
    assert sorted(fs.entries()) == ["plain"]
    assert unrecorded(file_sizes(str(tmp_path)), fs.entries()) == [
        "failed", "other_method", "sought"]


def test_files_no_writer_vouched_for_are_hashed_by_reading(tmp_path):
    (tmp_path / "a").write_bytes(b"hashed while written")
    (tmp_path / "b").write_bytes(b"never recorded")
    (tmp_path / "c").write_bytes(b"grew after it was hashed")
    written = {"a": checksums.file_entry(tmp_path / "a", checksums.SHA256),
               "c": checksums.entry(3, checksums.SHA256, "0" * 64)}
    files = _gather_checksums(str(tmp_path), written)
    algorithm = checksums.preferred()
    assert files == {"a": written["a"],
                     "b": checksums.file_entry(tmp_path / "b", algorithm),
                     "c": checksums.file_entry(tmp_path / "c", algorithm)}


def test_a_sha256_manifest_still_loads_and_still_catches_corruption(tmp_path, monkeypatch):
    """Checkpoints written before xxh3 carry sha256 under the key "sha256"."""
    model, opt = _model()
    monkeypatch.setattr(checksums, "preferred", lambda: checksums.SHA256)
    path = ckpt.save(str(tmp_path / "step_1"), model, opt, extra={"step": 1})
    monkeypatch.undo()
    files = _manifest(path)["files"]
    assert all(set(e) == {"bytes", "sha256"} for e in files.values())
    with open(os.path.join(path, _shard(path)), "rb") as f:
        assert files[_shard(path)]["sha256"] == hashlib.sha256(f.read()).hexdigest()
    fresh, fresh_opt = _model()
    assert ckpt.load(path, fresh, fresh_opt) == {"step": 1}
    for a, b in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(a, b)
    shard = os.path.join(path, _shard(path))
    data = bytearray(open(shard, "rb").read())
    data[len(data) // 2] ^= 0x01
    open(shard, "wb").write(bytes(data))
    with pytest.raises(ckpt.CheckpointError, match=r"__0_0.distcp is corrupt \(sha256 differs"):
        ckpt.load(path, fresh, fresh_opt)


def test_new_checkpoints_use_xxh3_and_catch_a_flipped_bit(tmp_path):
    pytest.importorskip("xxhash")  # a dependency; absent only from hand-made environments
    model, opt = _model()
    path = ckpt.save(str(tmp_path / "step_1"), model, opt)
    assert all(set(e) == {"bytes", "xxh3_128"} for e in _manifest(path)["files"].values())
    shard = os.path.join(path, _shard(path))
    data = bytearray(open(shard, "rb").read())
    data[-100] ^= 0x01
    open(shard, "wb").write(bytes(data))
    with pytest.raises(ckpt.CheckpointError, match=r"is corrupt \(xxh3_128 differs"):
        ckpt.load(path, *_model())


def test_checksums_this_installation_cannot_compute_are_named(tmp_path, monkeypatch):
    model, _ = _model()
    path = ckpt.save(str(tmp_path / "step_1"), model)
    manifest = _manifest(path)
    for entry in manifest["files"].values():
        for key in checksums.KNOWN:
            entry.pop(key, None)
        entry["blake3"] = "0" * 64
    manifest["self_checksum"] = {"blake3": "0" * 64}  # a later fullshard seals it so too
    with open(os.path.join(path, "fullshard.json"), "w") as f:
        json.dump(manifest, f)
    with pytest.raises(ckpt.CheckpointError, match="its checksums are blake3, which this "
                                                   "fullshard does not know"):
        ckpt.load(path, model)
    for entry in manifest["files"].values():
        entry["xxh3_128"] = entry.pop("blake3")
    manifest["self_checksum"] = {"xxh3_128": "0" * 32}
    with open(os.path.join(path, "fullshard.json"), "w") as f:
        json.dump(manifest, f)
    monkeypatch.setitem(sys.modules, "xxhash", None)  # as if not installed
    assert checksums.preferred() == checksums.SHA256
    with pytest.raises(ckpt.CheckpointError, match="needs the xxhash package: pip install"):
        ckpt.load(path, model)


def test_extra_is_written_through_the_hashing_stream(tmp_path):
    fs = HashingFileSystem(checksums.SHA256)
    with fs.create_stream(tmp_path / "extra.pt", "wb") as f:
        torch.save({"step": 3, "rng": torch.get_rng_state()}, f)
    assert fs.entries()["extra.pt"] == checksums.file_entry(tmp_path / "extra.pt",
                                                            checksums.SHA256)
    loaded = torch.load(io.BytesIO((tmp_path / "extra.pt").read_bytes()), weights_only=False)
    assert loaded["step"] == 3
