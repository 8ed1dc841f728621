"""Hugging Face causal LMs from a local folder (``--model hf:PATH``), no hub access.

Rank 0 loads the full model on the CPU in fp32 (the sharded parameters and the
optimizer work in fp32; ``parallel.precision`` picks the compute dtype), the other ranks
build it from its config on the meta device; the decoder layers named by the model's
``_no_split_modules`` become units, and the other ranks then receive rank 0's weights.
The folder's tokenizer is used when it has one; see ``corpus.py`` for the fallback.
"""

from __future__ import annotations

import os

import torch
import torch.nn as nn

from .config import ConfigError
from .corpus import ByteTokenizer, Tokenizer

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _transformers():
    try:
        import transformers
    except ImportError:
        raise ConfigError("model: hf:PATH needs the transformers package; install it with "
                          "pip install 'fullshard[hf]'") from None
    return transformers


def load_model(path: str, on_meta: bool = False) -> nn.Module:
    """The causal LM saved in ``path`` (``save_pretrained`` layout), in fp32, train mode;
    with ``on_meta`` only its structure, on the meta device (no weights read)."""
    transformers = _transformers()
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigError(f"model: {path!r} is not a Hugging Face model folder (no "
                          "config.json); hf:PATH takes a local folder, not a hub name")
    transformers.utils.logging.disable_progress_bar()  # one bar per rank is noise
    if on_meta:
        config = transformers.AutoConfig.from_pretrained(path)
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(path)
    model.config.use_cache = False  # training: no key/value cache to build
    return model.float().train()


def vocab_size(model: nn.Module) -> int:
    return model.get_input_embeddings().num_embeddings


class HFTokenizer:
    """The folder's tokenizer, adding no special tokens (documents are joined by EOS)."""

    name = "the model's tokenizer"

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.vocab_size = len(tokenizer)
        eos = tokenizer.eos_token_id
        self.separator = [] if eos is None else [eos]

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)


def load_tokenizer(path: str, model_vocab_size: int) -> Tokenizer:
    """The folder's tokenizer if it has one, else UTF-8 bytes clipped to the vocabulary."""
    if not any(os.path.isfile(os.path.join(path, name)) for name in TOKENIZER_FILES):
        return ByteTokenizer(model_vocab_size)
    tokenizer = HFTokenizer(_transformers().AutoTokenizer.from_pretrained(path))
    if tokenizer.vocab_size > model_vocab_size:
        raise ConfigError(f"model: the tokenizer in {path} has {tokenizer.vocab_size} ids, "
                          f"more than the model's {model_vocab_size} embeddings")
    return tokenizer


def logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, use_cache=False).logits
