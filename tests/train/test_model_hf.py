"""Fine-tuning tiny Hugging Face models (Llama- and GPT-2-style) at world size 2, and
exporting the result with ``fullshard ckpt export --hf`` back to Hugging Face."""

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from fullshard import FSDPModule
from fullshard.checkpoint.safetensors_files import SafetensorsFiles
from fullshard.cli import main as fullshard_main
from fullshard.testing import run_distributed
from fullshard.train.config.schema import get_preset
from fullshard.train.config.flags import apply_overrides
from fullshard.train.data import load_text
from fullshard.train.launch.launcher import Worker
from fullshard.train.loop import Trainer
from support.hf_folders import save_tiny_llama, write_jsonl_dataset
from support.train_runs import tensorboard_scalars

transformers = pytest.importorskip("transformers")


def _bpe_tokenizer():
    """A byte-level BPE tokenizer trained here on a little Shakespeare (no hub access)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator([load_text()[:50_000]], trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<eos>")


def _save_gpt2_with_tokenizer(path: str) -> None:
    """A GPT-2 with the BPE tokenizer; its embeddings are tied to its output layer."""
    tokenizer = _bpe_tokenizer()
    eos = tokenizer.eos_token_id
    config = transformers.GPT2Config(vocab_size=len(tokenizer), n_positions=64, n_embd=32,
                                     n_layer=2, n_head=4, bos_token_id=eos, eos_token_id=eos)
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(config).save_pretrained(path)
    tokenizer.save_pretrained(path)


def _matches_saved_model(model, model_dir: str) -> bool:
    """Every parameter and buffer (non-persistent ones too) of the sharded model equals the
    saved model's: each rank read its own shards from the folder (load_hf)."""
    saved = transformers.AutoModelForCausalLM.from_pretrained(model_dir).float()
    expected = {**dict(saved.named_parameters()), **dict(saved.named_buffers())}
    actual = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    assert actual.keys() == expected.keys()
    return all(torch.equal(v.full_tensor() if hasattr(v, "full_tensor") else v, expected[k])
               for k, v in actual.items())


def _fine_tune(model_dir: str, data: str, out: str) -> dict:
    cfg = apply_overrides(get_preset("debug"), {
        "model": f"hf:{model_dir}", "data": data, "steps": 4, "batch.seq_len": 16,
        "batch.batch_size": 2, "optim.lr": 1e-2, "optim.warmup_steps": 1, "eval.every": 0,
        "eval.sample_tokens": 4, "checkpoint.every": 0}, "test")
    rank, world = dist.get_rank(), dist.get_world_size()
    reads = []
    read = SafetensorsFiles.read

    def recorded(self, key, index=None, into=None):
        reads.append(key)
        return read(self, key, index, into)
    SafetensorsFiles.read = recorded  # this rank's process only
    try:
        trainer = Trainer(cfg, out, Worker(rank, world, rank, world, torch.device("cpu")))
    finally:
        SafetensorsFiles.read = read
    initial_match = _matches_saved_model(trainer.model, model_dir)
    trainer.run(resume=False)
    if trainer.log is None:
        return {"initial_match": initial_match, "streamed": bool(reads)}
    records = trainer.log.records
    block_names = set(trainer.model._no_split_modules)
    decoder_layers = [m for m in trainer.model.modules()  # sharded classes subclass them
                      if block_names & {c.__name__ for c in type(m).__mro__}]
    return {"initial_match": initial_match, "streamed": bool(reads),
            "tokenizer": trainer.workload.tokenizer.name,
            "val": [r["val_loss"] for r in records if "val_loss" in r],
            "losses": [r["loss"] for r in records if "loss" in r],
            "layers_sharded": [isinstance(m, FSDPModule) for m in decoder_layers]}


def _checkpoint_tensors(run: str) -> dict[str, torch.Tensor]:
    """Every model tensor of the run's latest checkpoint, read with torch's DCP alone."""
    from fullshard.checkpoint.export import model_tensors
    from fullshard.train.checkpoints import resolve_checkpoint

    path = resolve_checkpoint(run)
    state = {f"model.{name}": torch.empty(m.size, dtype=m.properties.dtype)
             for name, m in model_tensors(path).items()}
    dcp.load(state, checkpoint_id=path, no_dist=True)
    return {name.removeprefix("model."): t for name, t in state.items()}


def _export_and_reload(run: str, out: str, max_shard_size: str):
    """``fullshard ckpt export RUN OUT --hf``, then ``from_pretrained(OUT)``; checks that
    it holds exactly the checkpoint's weights."""
    assert fullshard_main(["ckpt", "export", run, out, "--hf",
                           "--max-shard-size", max_shard_size]) == 0
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    exported = model.state_dict()
    saved = _checkpoint_tensors(run)
    assert set(saved) <= set(exported)
    for name, tensor in saved.items():
        assert torch.equal(exported[name], tensor), name
    return model


@pytest.mark.slow
@pytest.mark.extended
def test_fine_tune_tiny_llama_and_gpt2_from_local_folders(tmp_path):
    save_tiny_llama(str(tmp_path / "llama"))
    _save_gpt2_with_tokenizer(str(tmp_path / "gpt2"))
    data = tmp_path / "data.jsonl"
    write_jsonl_dataset(data)
    for name, tokenizer in (("llama", "bytes"), ("gpt2", "the model's tokenizer")):
        results = run_distributed(_fine_tune, 2, str(tmp_path / name), str(data),
                                  str(tmp_path / f"out-{name}"), timeout=240)
        assert all(r["initial_match"] for r in results), name
        assert all(r["streamed"] for r in results), name  # each rank read its shards
        result = results[0]
        assert result["tokenizer"] == tokenizer
        assert result["layers_sharded"] == [True, True], name
        assert len(result["losses"]) == 4 and all(map(torch.isfinite, map(torch.tensor,
                                                                          result["losses"])))
        assert result["val"][-1] < result["val"][0], name
        assert (tmp_path / f"out-{name}" / "checkpoints" / "latest").exists()
        # Back to Hugging Face: the trained weights, the tokenizer the run had (if any).
        exported = tmp_path / f"hf-{name}"
        model = _export_and_reload(str(tmp_path / f"out-{name}"), str(exported), "20KB")
        assert len(list(exported.glob("model-*.safetensors"))) > 1
        assert (exported / "tokenizer.json").exists() == (name == "gpt2")
        before = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / name))
        assert not torch.equal(model.lm_head.weight, before.lm_head.weight)
        if name == "gpt2":  # tied: one tensor, written once, tied again on load
            assert model.lm_head.weight is model.transformer.wte.weight


def _fullshard(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fullshard", *args], capture_output=True,
                          text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.mark.extended
def test_fine_tune_a_llama_with_its_tokenizer_then_generate_with_transformers(tmp_path):
    """The whole flow as a person runs it: a Llama folder with a tokenizer, fullshard
    train on JSONL over 2 ranks, export, transformers loads and generates."""
    model_dir, run, exported = tmp_path / "llama", tmp_path / "run", tmp_path / "hf"
    tokenizer = _bpe_tokenizer()
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    write_jsonl_dataset(tmp_path / "data.jsonl")
    prompt = "ROMEO:"
    trained = _fullshard("train", "--preset", "debug", "--model", f"hf:{model_dir}",
                         "--data", str(tmp_path / "data.jsonl"), "--steps", "6",
                         "--batch.seq-len", "16", "--batch.batch-size", "2",
                         "--optim.lr", "1e-2", "--optim.warmup-steps", "1", "--eval.every", "0",
                         "--eval.sample-prompt", prompt, "--eval.sample-tokens", "8",
                         "--eval.temperature", "0", "--metrics.tensorboard", "true",
                         "--out", str(run))
    assert trained.returncode == 0, trained.stderr[-3000:]
    losses = [json.loads(line)["loss"] for line in (run / "metrics.jsonl").open()
              if "loss" in json.loads(line)]
    logged = tensorboard_scalars(str(run))["loss"]  # rank 0 sent every step on
    assert [step for step, _ in logged] == [1, 2, 3, 4, 5, 6]
    assert [value for _, value in logged] == pytest.approx(losses)
    assert sorted(os.listdir(run / "hf")) == sorted(
        ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"]
        + [f for f in os.listdir(run / "hf") if f == "special_tokens_map.json"])
    exported_model = _export_and_reload(str(run), str(exported), "5GB")
    assert (exported / "model.safetensors").exists()  # small enough for one file
    assert not (exported / "model.safetensors.index.json").exists()
    loaded = transformers.AutoTokenizer.from_pretrained(str(exported))
    ids = loaded(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"]
    generated = exported_model.generate(ids, max_new_tokens=8, do_sample=False)
    text = loaded.decode(generated[0])
    assert generated.shape[1] == ids.shape[1] + 8
    # Greedy decoding in transformers continues the prompt as the trainer's own sample did.
    assert f"--- sample after 6 steps ---\n{text}\n---" in trained.stdout


def test_a_folder_with_safetensors_is_read_by_every_rank_one_without_by_rank_0(tmp_path):
    """``--model hf:PATH``: where the folder has safetensors files every rank builds the
    model with its parameters on the meta device and reads its own shards after sharding
    (load_hf); a folder holding only ``pytorch_model.bin`` is loaded whole by rank 0 and
    sent to the others after sharding, as before."""
    import shutil

    from fullshard.train.model import build_workload
    streamed_dir, bin_dir = tmp_path / "llama", tmp_path / "bin_only"
    save_tiny_llama(str(streamed_dir))
    bin_dir.mkdir()
    shutil.copy(streamed_dir / "config.json", bin_dir / "config.json")
    saved = transformers.AutoModelForCausalLM.from_pretrained(str(streamed_dir)).state_dict()
    torch.save(saved, bin_dir / "pytorch_model.bin")
    data = tmp_path / "data.jsonl"
    write_jsonl_dataset(data)

    def workload(model_dir, rank: int):
        cfg = apply_overrides(get_preset("debug"), {"model": f"hf:{model_dir}",
                                                    "data": str(data)}, "test")
        return build_workload(cfg, rank, 2)
    for rank in (0, 1):
        streamed = workload(streamed_dir, rank)
        assert streamed.weights_folder == str(streamed_dir) and streamed.initial_state is None
        assert all(p.is_meta for p in streamed.model.parameters())
        assert not any(b.is_meta for b in streamed.model.buffers())  # rotary frequencies
    sent = workload(bin_dir, 0)
    assert sent.weights_folder is None
    assert sent.initial_state.keys() == saved.keys()
    assert all(torch.equal(sent.initial_state[k], v) for k, v in saved.items())
    assert workload(bin_dir, 1).initial_state == {}
