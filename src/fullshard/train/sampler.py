"""Which token windows each rank reads, step after step, resumably.

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

from dataclasses import asdict, dataclass

import torch

from .config import ConfigError


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
