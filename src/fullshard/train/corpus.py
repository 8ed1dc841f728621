"""Training text and the tokenizers that turn it into ids.

``--data`` names the shipped ``tinyshakespeare`` or a file: plain text (one document) or
JSONL (``.jsonl``/``.json``: one JSON object a line, its ``"text"`` field a document).

Which tokenizer:
- GPT models (``--model gpt``) read characters: the ids are the file's distinct
  characters in sorted order, so the model's ``gpt.vocab_size`` must be at least their
  number (65 for Tiny Shakespeare).
- Hugging Face models use the tokenizer saved in their folder when there is one
  (documents are separated by its EOS token). A folder without one (e.g. a model made
  with ``save_pretrained`` alone) falls back to UTF-8 bytes: id = byte value, and bytes
  at or above the model's vocabulary size are clipped to its last id.
"""

from __future__ import annotations

import json
import os
from typing import Protocol

import torch

from .config import ConfigError
from .data import load_text

BUILTIN = {"tinyshakespeare": "tinyshakespeare.txt"}


class Tokenizer(Protocol):
    name: str
    vocab_size: int
    separator: list[int]  # ids placed between documents

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


def read_documents(source: str) -> list[str]:
    """The documents of ``--data``: the shipped text by name, or a text/JSONL file."""
    if source in BUILTIN:
        return [load_text(BUILTIN[source])]
    if not os.path.isfile(source):
        raise ConfigError(f"data: no such file {source!r} (or use one of: "
                          f"{', '.join(BUILTIN)})")
    with open(source, encoding="utf-8") as f:
        if not source.endswith((".jsonl", ".json")):
            return [f.read()]
        documents = []
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ConfigError(f"data: {source}:{number} is not JSON ({err.msg})") from None
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise ConfigError(f"data: {source}:{number} has no string field \"text\"")
            documents.append(record["text"])
    if not documents:
        raise ConfigError(f"data: {source} holds no documents")
    return documents


class CharTokenizer:
    """One id per distinct character of the corpus, in sorted order."""

    name = "characters"

    def __init__(self, documents: list[str]):
        self.chars = sorted(set("\n".join(documents)))
        self.ids = {c: i for i, c in enumerate(self.chars)}
        self.vocab_size = len(self.chars)
        self.separator = [self.ids["\n"]] if "\n" in self.ids else []

    def encode(self, text: str) -> list[int]:
        unknown = sorted(set(text) - self.ids.keys())
        if unknown:
            raise ConfigError(f"eval.sample_prompt: characters {''.join(unknown)!r} do not "
                              "occur in the training text")
        return [self.ids[c] for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(self.chars[i] for i in ids)


class ByteTokenizer:
    """UTF-8 bytes as ids, clipped to ``vocab_size - 1`` (for models without a tokenizer)."""

    name = "bytes"

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.separator = self.encode("\n")

    def encode(self, text: str) -> list[int]:
        top = self.vocab_size - 1
        return [min(b, top) for b in text.encode("utf-8")]

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def tokenize(documents: list[str], tokenizer: Tokenizer) -> torch.Tensor:
    """All documents as one int64 tensor of ids, the tokenizer's separator between them."""
    ids: list[int] = []
    for i, doc in enumerate(documents):
        if i:
            ids.extend(tokenizer.separator)
        ids.extend(tokenizer.encode(doc))
    return torch.tensor(ids, dtype=torch.long)


def split(tokens: torch.Tensor, val_fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, validation): validation is the last ``val_fraction`` of the ids."""
    n_val = int(len(tokens) * val_fraction)
    return tokens[:len(tokens) - n_val], tokens[len(tokens) - n_val:]
