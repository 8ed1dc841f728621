"""Fine-tuning tiny Hugging Face models (Llama- and GPT-2-style) at world size 2."""

import json

import pytest
import torch
import torch.distributed as dist

from fullshard import FSDPModule
from fullshard.testing import run_distributed
from fullshard.train.config import apply_overrides, get_preset
from fullshard.train.data import load_text
from fullshard.train.launch import Worker
from fullshard.train.loop import Trainer

transformers = pytest.importorskip("transformers")


def _save_llama(path: str) -> None:
    """A Llama without a tokenizer in its folder: the trainer falls back to bytes."""
    config = transformers.LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(path)


def _save_gpt2_with_tokenizer(path: str) -> None:
    """A GPT-2 with a byte-level BPE tokenizer trained here (no hub access)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator([load_text()[:50_000]], trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<eos>")
    eos = tokenizer.eos_token_id
    config = transformers.GPT2Config(vocab_size=len(tokenizer), n_positions=64, n_embd=32,
                                     n_layer=2, n_head=4, bos_token_id=eos, eos_token_id=eos)
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(config).save_pretrained(path)
    tokenizer.save_pretrained(path)


def _matches_saved_model(model, model_dir: str) -> bool:
    """Every parameter and buffer (non-persistent ones too) of the sharded model equals the
    saved model's: only rank 0 read the folder, the others received its weights."""
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
    trainer = Trainer(cfg, out, Worker(rank, world, rank, world, torch.device("cpu")))
    initial_match = _matches_saved_model(trainer.model, model_dir)
    trainer.run(resume=False)
    if trainer.log is None:
        return {"initial_match": initial_match}
    records = trainer.log.records
    block_names = set(trainer.model._no_split_modules)
    decoder_layers = [m for m in trainer.model.modules()  # sharded classes subclass them
                      if block_names & {c.__name__ for c in type(m).__mro__}]
    return {"initial_match": initial_match, "tokenizer": trainer.workload.tokenizer.name,
            "val": [r["val_loss"] for r in records if "val_loss" in r],
            "losses": [r["loss"] for r in records if "loss" in r],
            "layers_sharded": [isinstance(m, FSDPModule) for m in decoder_layers]}


def test_fine_tune_tiny_llama_and_gpt2_from_local_folders(tmp_path):
    _save_llama(str(tmp_path / "llama"))
    _save_gpt2_with_tokenizer(str(tmp_path / "gpt2"))
    data = tmp_path / "data.jsonl"
    with open(data, "w") as f:
        for paragraph in load_text()[:30_000].split("\n\n"):
            f.write(json.dumps({"text": paragraph}) + "\n")
    for name, tokenizer in (("llama", "bytes"), ("gpt2", "the model's tokenizer")):
        results = run_distributed(_fine_tune, 2, str(tmp_path / name), str(data),
                                  str(tmp_path / f"out-{name}"), timeout=240)
        assert all(r["initial_match"] for r in results), name
        result = results[0]
        assert result["tokenizer"] == tokenizer
        assert result["layers_sharded"] == [True, True], name
        assert len(result["losses"]) == 4 and all(map(torch.isfinite, map(torch.tensor,
                                                                          result["losses"])))
        assert result["val"][-1] < result["val"][0], name
        assert (tmp_path / f"out-{name}" / "checkpoints" / "latest").exists()
