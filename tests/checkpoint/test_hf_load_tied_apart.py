"""A checkpoint that stores a tied head with values of its own: from_pretrained unties it
and uses the stored head; fullshard's trainer does the same, and load_hf into a model
that ties them says so instead of dropping the head."""

from __future__ import annotations

import pytest
import torch

from fullshard.checkpoint import CheckpointError, load_hf, parameters_on_meta
from fullshard.train.model import load_hf_model
from support.catalogue import matches_documented

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")


def _save_with_own_head(folder: str) -> None:
    """A tied Qwen2 whose saved lm_head.weight differs from its embedding."""
    config = transformers.Qwen2Config(vocab_size=50, hidden_size=16, intermediate_size=24,
                                      num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(folder)
    config.tie_word_embeddings = True
    config.save_pretrained(folder)


def test_a_stored_head_is_used_untied_as_from_pretrained_does(tmp_path):
    folder = str(tmp_path / "qwen")
    _save_with_own_head(folder)
    transformers.utils.logging.set_verbosity_error()
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder).float()
    with pytest.warns(UserWarning) as caught:
        model = load_hf_model(folder, on_meta=True)
    assert any(matches_documented("E235", f"UserWarning: {w.message}") for w in caught)
    load_hf(model, folder)
    ids = torch.arange(10).view(1, 10)
    assert torch.equal(model.lm_head.weight, reference.lm_head.weight)
    assert torch.allclose(model(ids).logits, reference(ids).logits)


def test_load_hf_into_a_tied_model_names_the_stored_head(tmp_path):
    folder = str(tmp_path / "qwen")
    _save_with_own_head(folder)
    config = transformers.AutoConfig.from_pretrained(folder)
    with parameters_on_meta():
        model = transformers.AutoModelForCausalLM.from_config(config)
    with pytest.raises(CheckpointError) as error:
        load_hf(model, folder)
    assert matches_documented("E234", f"CheckpointError: {error.value}"), error.value
