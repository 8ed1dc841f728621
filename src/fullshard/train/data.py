"""Character-level text data: Tiny Shakespeare ships inside the package (public domain)."""

from __future__ import annotations

from importlib import resources

import torch


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
