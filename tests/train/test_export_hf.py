"""``fullshard ckpt export --hf`` of the built-in GPT (as GPT-2), the folder and file
layout, and the one-line errors of its flags (one process, no training: a checkpoint
laid out as ``fullshard train`` lays it out). Hugging Face models trained with
``--model hf:DIR``: tests/train/test_model_hf.py."""

import json

import pytest
import torch

from fullshard import checkpoint
from fullshard.cli import main
from fullshard.train.export.hf import parse_size
from support.hf_folders import gpt_run_folder

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("tied", [True, False])
def test_the_gpt_exports_as_gpt2_with_the_same_logits(tmp_path, tied, capsys):
    model = gpt_run_folder(str(tmp_path / "run"), tie_embeddings=tied)
    out = tmp_path / "hf"
    assert main(["ckpt", "export", str(tmp_path / "run"), str(out), "--hf",
                 "--max-shard-size", "30KB"]) == 0
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) >= 3 and all(p.stat().st_size <= 30_000 + 1000  # header
                                    for p in out.glob("model-*.safetensors"))
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == shards
    assert index["metadata"]["total_size"] == sum(
        p.numel() * 4 for p in model.parameters())
    assert ("lm_head.weight" in index["weight_map"]) is not tied
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out))
    assert type(hf).__name__ == "GPT2LMHeadModel"
    ids = torch.randint(0, model.cfg.vocab_size, (2, model.cfg.seq_len))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model(ids), rtol=1e-5, atol=1e-5)
    assert str(out / "config.json") in capsys.readouterr().out


def test_export_and_inspect_take_a_run_its_latest_file_or_a_step(tmp_path, capsys):
    gpt_run_folder(str(tmp_path / "run"))
    run = tmp_path / "run"
    names = (run, run / "checkpoints", run / "checkpoints" / "latest",
             run / "checkpoints" / "step_000003")
    for name in names:
        assert main(["ckpt", "inspect", str(name)]) == 0, name
        assert f"checkpoint   {run / 'checkpoints' / 'step_000003'}" in capsys.readouterr().out
    single = tmp_path / "model.safetensors"
    assert main(["ckpt", "export", str(run / "checkpoints" / "latest"), str(single)]) == 0
    assert single.stat().st_size > 0
    # A second export into the same folder with one shard leaves no file of the first.
    assert main(["ckpt", "export", str(run), str(tmp_path / "hf"), "--hf",
                 "--max-shard-size", "20KB"]) == 0
    assert main(["ckpt", "export", str(run), str(tmp_path / "hf"), "--hf"]) == 0
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["config.json",
                                                                   "model.safetensors"]


def test_sizes_count_as_hugging_face_does():
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("500MB") == 500 * 10**6
    assert parse_size("2GiB") == 2 * 2**30
    assert parse_size("1.5kb") == 1500
    assert parse_size("4096") == 4096


@pytest.mark.parametrize("args, message", [
    (["--hf", "--max-shard-size", "big"], "--max-shard-size: expected a positive size such "
                                          "as 5GB, 500MB or 2GiB, got 'big'"),
    (["--hf", "--max-shard-size", "0MB"], "--max-shard-size: expected a positive size"),
    (["--max-shard-size", "1GB"], "--max-shard-size: applies to --hf exports only"),
])
def test_bad_export_flags_are_one_line_errors(tmp_path, args, message, capsys):
    gpt_run_folder(str(tmp_path / "run"))
    assert main(["ckpt", "export", str(tmp_path / "run"), str(tmp_path / "hf"), *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_hf_export_of_a_checkpoint_outside_a_run_or_not_its_model_is_refused(tmp_path,
                                                                            capsys):
    model = gpt_run_folder(str(tmp_path / "run"))
    alone = tmp_path / "alone" / "step_1"
    checkpoint.save(str(alone), model)
    assert main(["ckpt", "export", str(alone), str(tmp_path / "hf"), "--hf"]) == 2
    err = capsys.readouterr().err
    assert "does not lie in a fullshard train run" in err and err.count("\n") == 1
    # config.toml describing another shape than the checkpoint holds
    config = tmp_path / "run" / "config.toml"
    config.write_text(config.read_text().replace("n_layers = 2", "n_layers = 3"))
    assert main(["ckpt", "export", str(tmp_path / "run"), str(tmp_path / "hf"), "--hf"]) == 2
    err = capsys.readouterr().err
    assert "step_000003 lacks layers.2.attn.proj.bias, layers.2.attn.proj.weight," in err
    assert "it does not hold the model" in err and err.count("\n") == 1
