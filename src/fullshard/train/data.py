"""Training text and the tokenizers that turn it into ids, and which token windows each
rank reads, step after step, resumably.

Character-level text data: Tiny Shakespeare ships inside the package (public domain).
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

Note [epochs of disjoint windows]
An epoch cuts the training ids into non-overlapping windows of ``seq_len + 1`` ids
(input and next-token target), starting at an offset drawn for that epoch so that
windows straddle different boundaries from one epoch to the next, and visits them in an
order also drawn for that epoch. Every micro-batch takes the next ``world * batch_size``
windows of that order and gives rank r the r-th slice (as ``DistributedSampler`` does
with ``drop_last``): no window is read twice in an epoch, nor by two ranks. Offset and
order come from a generator seeded by (seed, epoch), so the whole position is two
integers, ``DataPosition``, which checkpoints store: a resumed run reads exactly the
windows an uninterrupted one would have.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from importlib import resources
from typing import Protocol

import torch

from .config.schema import ConfigError
from .config.paths import not_text


# -- the shipped text ------------------------------------------------------------------

def load_text(name: str = "tinyshakespeare.txt") -> str:
    return resources.files("fullshard.train").joinpath("data", name).read_text(encoding="utf-8")


class CharDataset:
    """Encodes a text as character ids and serves random (input, next-char target) windows."""

    def __init__(self, text: str, seq_len: int):
        self.chars = sorted(set(text))
        self.stoi = {c: i for i, c in enumerate(self.chars)}
        self.data = torch.tensor([self.stoi[c] for c in text], dtype=torch.long)
        self.seq_len = seq_len

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def batch(self, batch_size: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(0, len(self.data) - self.seq_len - 1, (batch_size,),
                               generator=generator)
        x = torch.stack([self.data[s:s + self.seq_len] for s in starts])
        y = torch.stack([self.data[s + 1:s + 1 + self.seq_len] for s in starts])
        return x, y

    def decode(self, ids) -> str:
        return "".join(self.chars[i] for i in ids)


# -- documents and tokenizers ----------------------------------------------------------

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
    try:
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
                    raise ConfigError(f"data: {source}:{number} is not JSON "
                                      f"({err.msg})") from None
                if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                    raise ConfigError(f"data: {source}:{number} has no string field \"text\"")
                documents.append(record["text"])
    except UnicodeDecodeError as err:  # a binary file, or another encoding
        raise not_text("data", source, err) from None
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


# -- which windows each rank reads -----------------------------------------------------

@dataclass
class DataPosition:
    """Where the next micro-batch starts: the epoch, and the windows of its order used."""

    epoch: int = 0
    cursor: int = 0


class EpochSampler:
    """This rank's micro-batches of training windows; see Note [epochs of disjoint windows]."""

    def __init__(self, tokens: torch.Tensor, seq_len: int, batch_size: int, rank: int,
                 world: int, seed: int):
        self.tokens, self.seq_len, self.batch_size = tokens, seq_len, batch_size
        self.rank, self.world, self.seed = rank, world, seed
        self.per_batch = world * batch_size
        fewest = (len(tokens) - seq_len) // seq_len  # windows at the largest offset
        if fewest < self.per_batch:
            raise ConfigError(
                f"batch.batch_size: {len(tokens):,} training tokens make {max(fewest, 0)} "
                f"windows of {seq_len}, fewer than one micro-batch ({world} ranks x "
                f"{batch_size}); use less batch.seq_len or batch.batch_size, or more data")
        self.position = DataPosition()
        self._epoch_order: tuple[int, int, torch.Tensor] | None = None  # (epoch, offset, order)

    def _order(self) -> tuple[int, torch.Tensor]:
        epoch = self.position.epoch
        if self._epoch_order is None or self._epoch_order[0] != epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            offset = int(torch.randint(0, self.seq_len, (1,), generator=g))
            count = (len(self.tokens) - 1 - offset) // self.seq_len
            self._epoch_order = (epoch, offset, torch.randperm(count, generator=g))
        return self._epoch_order[1], self._epoch_order[2]

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each ``batch_size x seq_len``, for this rank."""
        offset, order = self._order()
        if self.position.cursor + self.per_batch > len(order):  # the epoch's tail is dropped
            self.position = DataPosition(self.position.epoch + 1, 0)
            offset, order = self._order()
        start = self.position.cursor + self.rank * self.batch_size
        windows = order[start:start + self.batch_size]
        self.position.cursor += self.per_batch
        return windows_at(self.tokens, offset + windows * self.seq_len, self.seq_len)

    def state_dict(self) -> dict:
        return asdict(self.position)

    def load_state_dict(self, state: dict) -> None:
        self.position = DataPosition(**state)


def windows_at(tokens: torch.Tensor, starts: torch.Tensor, seq_len: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs ``tokens[s : s+seq_len]`` and targets one id later, for each start ``s``."""
    index = starts.unsqueeze(1) + torch.arange(seq_len + 1)
    chunk = tokens[index]
    return chunk[:, :-1], chunk[:, 1:]


def validation_batches(tokens: torch.Tensor, seq_len: int, batch_size: int, rank: int,
                       world: int, max_batches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's fixed validation micro-batches (the same at every evaluation): the
    first windows of the validation ids, ranks taking disjoint slices. Every rank gets
    the same number of batches, so evaluations issue the same collectives everywhere."""
    count = max(len(tokens) - 1, 0) // seq_len
    per_batch = world * batch_size
    n_batches = min(max_batches, count // per_batch)
    if n_batches == 0:
        raise ConfigError(
            f"batch.val_fraction: the validation split has {len(tokens):,} tokens, fewer "
            f"than one micro-batch ({world} ranks x {batch_size} x {seq_len}); raise it")
    batches = []
    for i in range(n_batches):
        first = i * per_batch + rank * batch_size
        starts = torch.arange(first, first + batch_size) * seq_len
        batches.append(windows_at(tokens, starts, seq_len))
    return batches
