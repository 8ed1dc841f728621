"""One verification path for every reader of a checkpoint: what a directory is, and the
one-line error each kind of damage gets, from load, inspect, export and export --hf."""

import json
import os
import warnings

import pytest
import torch

from fullshard import checkpoint
from fullshard.checkpoint import CheckpointError, Kind, UnverifiedCheckpointWarning, classify
from fullshard.checkpoint.export import export_safetensors, inspect
from fullshard.cli import main

from support.checkpoint_dirs import (flip_byte, fullshard_checkpoint, shard_file, small_model,
                             torch_checkpoint, truncate)


def _one_line(err: pytest.ExceptionInfo) -> str:
    message = str(err.value)
    assert "\n" not in message
    return message


def test_each_kind_of_directory_is_told_apart(tmp_path):
    complete = fullshard_checkpoint(str(tmp_path / "a"))
    assert classify(complete) is Kind.FULLSHARD
    assert classify(torch_checkpoint(str(tmp_path / "torch"))) is Kind.TORCH_DCP
    os.makedirs(tmp_path / "plain")
    (tmp_path / "plain" / "notes.txt").write_text("hello")
    assert classify(str(tmp_path / "plain")) is Kind.NOT_A_CHECKPOINT
    unfinished = tmp_path / "a" / ".step_2.tmp"
    os.makedirs(unfinished)
    assert classify(str(unfinished)) is Kind.UNFINISHED
    os.remove(os.path.join(complete, "fullshard.json"))  # extra.pt says fullshard wrote it
    assert classify(complete) is Kind.UNFINISHED
    os.remove(os.path.join(complete, "extra.pt"))  # DCP's metadata still says so
    assert classify(complete) is Kind.UNFINISHED


def test_every_reader_names_the_cause_of_a_directory_that_is_no_checkpoint(tmp_path):
    os.makedirs(tmp_path / "plain")
    for read in (lambda p: checkpoint.load(p, small_model()), inspect,
                 lambda p: export_safetensors(p, str(tmp_path / "x.safetensors"))):
        with pytest.raises(CheckpointError, match="is not a checkpoint: it holds neither "
                                                  "fullshard.json") as err:
            read(str(tmp_path / "plain"))
        assert "did not finish" not in _one_line(err)


def test_export_refuses_a_flipped_byte_and_writes_nothing(tmp_path):
    path = fullshard_checkpoint(str(tmp_path))
    flip_byte(shard_file(path))
    out = tmp_path / "model.safetensors"
    with pytest.raises(CheckpointError, match=r"__0_0.distcp is corrupt") as err:
        export_safetensors(path, str(out))
    _one_line(err)
    assert not out.exists() and not (tmp_path / "model.safetensors.partial").exists()


def test_the_cli_export_of_a_truncated_shard_is_one_line_and_exit_2(tmp_path, capsys):
    path = fullshard_checkpoint(str(tmp_path))
    truncate(shard_file(path))
    assert main(["ckpt", "export", path, str(tmp_path / "m.safetensors")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "__0_0.distcp has" in err and "truncated" in err


def test_a_damaged_manifest_is_named_even_where_it_still_parses(tmp_path):
    path = fullshard_checkpoint(str(tmp_path))
    manifest_file = os.path.join(path, "fullshard.json")
    text = open(manifest_file).read()
    with open(manifest_file, "w") as f:
        f.write(text[:-5])  # cut short: not JSON
    with pytest.raises(CheckpointError, match=r"fullshard.json is damaged \(") as err:
        checkpoint.load(path, small_model())
    _one_line(err)
    manifest = json.loads(text)
    manifest["world_size"] = 3  # still a manifest, but not the one the save wrote
    with open(manifest_file, "w") as f:
        json.dump(manifest, f)
    with pytest.raises(CheckpointError, match="its own xxh3_128 differs from self_checksum"):
        inspect(path)


def test_a_format_1_manifest_without_its_own_checksum_still_loads(tmp_path):
    model = small_model()
    path = fullshard_checkpoint(str(tmp_path), model)
    manifest_file = os.path.join(path, "fullshard.json")
    manifest = json.load(open(manifest_file))
    del manifest["self_checksum"]
    manifest["format"] = 1
    with open(manifest_file, "w") as f:
        json.dump(manifest, f)
    fresh = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 3))
    assert checkpoint.load(path, fresh) == {"step": 1}
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters()))


def test_latest_naming_a_missing_checkpoint_is_named(tmp_path):
    fullshard_checkpoint(str(tmp_path))
    (tmp_path / "latest").write_text("step_9")
    with pytest.raises(CheckpointError, match=r"latest names 'step_9', which is not a "
                                              r"checkpoint in") as err:
        checkpoint.load(str(tmp_path), small_model())
    _one_line(err)



@pytest.mark.parametrize("content", [b"\x8f\xfe\x00\x13\xc3(\x07\xff" * 8, b"", b"\n"],
                         ids=["random bytes", "empty", "a newline"])
def test_latest_holding_no_name_is_called_unreadable(tmp_path, content):
    fullshard_checkpoint(str(tmp_path))
    (tmp_path / "latest").write_bytes(content)
    with pytest.raises(CheckpointError, match=rf"latest does not hold a checkpoint's name \(its "
                                              rf"{len(content)} bytes are not a step_N name"
                                              ) as err:
        checkpoint.load(str(tmp_path), small_model())
    assert "''" not in str(err.value)
    _one_line(err)

def test_a_torch_checkpoint_loads_unverified_with_a_warning(tmp_path):
    source = small_model()
    with torch.no_grad():
        for p in source.parameters():
            p.add_(1.0)
    path = torch_checkpoint(str(tmp_path / "torch"), source)
    fresh = small_model()
    with pytest.warns(UnverifiedCheckpointWarning, match="without fullshard's fullshard.json"):
        assert checkpoint.load(path, fresh) is None
    assert all(torch.equal(a, b) for a, b in zip(source.parameters(), fresh.parameters()))
    with pytest.warns(UnverifiedCheckpointWarning):
        assert checkpoint.open_checkpoint(path).verified is False
    with pytest.warns(UnverifiedCheckpointWarning):
        info = inspect(path)
    assert info["world_size"] is None and "unverified" in info["checksums"]
    assert not info["failed"]


def test_an_unverified_checkpoint_that_cannot_be_read_is_one_line(tmp_path):
    path = torch_checkpoint(str(tmp_path / "torch"))
    truncate(shard_file(path), 0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnverifiedCheckpointWarning)
        with pytest.raises(CheckpointError, match="could not be read") as err:
            checkpoint.load(path, small_model())
    _one_line(err)
    flip_byte(os.path.join(path, ".metadata"), 0.01)
    with pytest.raises(CheckpointError, match=r"\.metadata cannot be read") as err:
        checkpoint.load(path, small_model())
    _one_line(err)


@pytest.mark.parametrize("kind", ["fullshard", "torch"])
def test_inspect_of_a_damaged_checkpoint_says_so_after_its_table(kind, tmp_path, capsys):
    """The table, then one line on stderr and exit code 1; a torch DCP checkpoint (no
    checksums) is read back tensor by tensor, which finds a file cut short."""
    from support.catalogue import matches_documented

    path = (fullshard_checkpoint(str(tmp_path), small_model()) if kind == "fullshard"
            else torch_checkpoint(str(tmp_path / "torch")))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnverifiedCheckpointWarning)
        assert main(["ckpt", "inspect", path]) == 0
        assert "read back" in capsys.readouterr().out or kind == "fullshard"
        truncate(shard_file(path), 0.1)
        assert main(["ckpt", "inspect", path]) == 1
    out, err = capsys.readouterr()
    assert "0.weight" in out and "failed verification" not in out.splitlines()[-1]
    (line,) = err.strip().splitlines()
    source = "metadata" if kind == "torch" else "manifest"
    assert f"the table above is from its {source}" in line, line
    assert matches_documented("E169", line.replace("its metadata", "its manifest")), line


def test_the_trainer_reads_which_job_saved_through_the_verification(tmp_path):
    from fullshard.train.checkpoints import saved_job

    out = tmp_path / "run"
    checkpoint.save(str(out / "checkpoints" / "step_000001"), small_model(),
                    extra={"step": 1, "job": "abc"})
    assert saved_job(str(out)) == "abc"
    flip_byte(str(out / "checkpoints" / "step_000001" / "extra.pt"))
    with pytest.raises(CheckpointError, match=r"extra.pt is corrupt"):
        saved_job(str(out))
