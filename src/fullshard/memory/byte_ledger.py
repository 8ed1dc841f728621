"""Byte counts of what a replayed step holds (memory/replay.py): each buffer under a key,
in one of the estimate's categories, on the device or the host; and the buffer pool's
free lists with sizes in place of tensors."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

from ..core.comm import FreeLists

SHARDED_PARAMS = "sharded parameters"
GRADIENTS = "gradients"
OPTIMIZER = "optimizer states"
UNSHARDED = "unsharded parameters"
ACTIVATIONS = "activations"
COMMUNICATION = "communication buffers"
CATEGORIES = (SHARDED_PARAMS, GRADIENTS, OPTIMIZER, UNSHARDED, ACTIVATIONS, COMMUNICATION)


def round_up(numel: int, to: int = 4096) -> int:
    return -(-numel // to) * to


@dataclass
class Peak:
    total: int = -1
    breakdown: dict[str, int] = field(default_factory=dict)


class ByteLedger:
    """Bytes alive per category, for the device and (offload) the host."""

    def __init__(self):
        self.device: Counter = Counter()
        self.host = 0
        self.host_peak = 0  # the most host memory alive at once (offloaded gradients included)
        self._live: dict[object, tuple[str, int, bool]] = {}

    def alloc(self, key: object, category: str, nbytes: int, on_host: bool = False) -> None:
        assert key not in self._live, key
        self._live[key] = (category, nbytes, on_host)
        if on_host:
            self.host += nbytes
            self.host_peak = max(self.host_peak, self.host)
        else:
            self.device[category] += nbytes

    def free(self, key: object) -> None:
        category, nbytes, on_host = self._live.pop(key)
        if on_host:
            self.host -= nbytes
        else:
            self.device[category] -= nbytes

    def holds(self, key: object) -> bool:
        return key in self._live


class BytePool(FreeLists[tuple]):
    """BufferPool with byte counts: the same keys (all on the compute device), the same
    free lists and keep-or-drop rule."""

    def __init__(self, ledger: ByteLedger, max_numel: int):
        super().__init__(max_numel)
        self.ledger = ledger
        self._count = 0

    def take(self, numel: int, dtype: torch.dtype) -> tuple:
        handle = self.pop((numel, dtype))
        if handle is None:
            self._count += 1
            handle = ("pool", self._count, numel, dtype)
            self.ledger.alloc(handle, COMMUNICATION, numel * dtype.itemsize)
        return handle

    def give(self, handle: tuple | None) -> None:
        if handle is None:
            return
        _, _, numel, dtype = handle
        if not self.push((numel, dtype), numel, handle):
            self.ledger.free(handle)
