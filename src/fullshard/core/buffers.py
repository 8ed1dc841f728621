"""BufferPool: communication buffers reused across steps.

Note [which buffers are pooled]
Every step moves the same groups through the same collectives, so the gather
output, the gradient send buffer and gloo's receive buffer have the same sizes
step after step. Buffers up to ``max_numel`` elements are kept when released and
handed out again for the same (size, dtype, device): after the first step no new
communication buffer is allocated. Larger buffers are not kept: holding a large
group's idle buffers while another group computes would raise the peak memory
that sharding exists to lower (on CUDA the caching allocator reuses them anyway;
on CPU they go back to the system between uses). At most ``max_per_key`` idle
buffers are kept per key, which covers a group in use plus one prefetched.
"""

from __future__ import annotations

from typing import Generic, Hashable, TypeVar

import torch

DEFAULT_MAX_NUMEL = 4 << 20  # 16 MiB of fp32

B = TypeVar("B")


class FreeLists(Generic[B]):
    """Idle buffers by key, kept under the pool's rule (Note [which buffers are pooled]).
    What a buffer is and how it is made is the caller's: BufferPool holds tensors, the
    memory estimator (memory/replay.py) byte counts."""

    def __init__(self, max_numel: int = DEFAULT_MAX_NUMEL, max_per_key: int = 2):
        self.max_numel = max_numel
        self.max_per_key = max_per_key
        self._free: dict[Hashable, list[B]] = {}

    def keeps(self, numel: int) -> bool:
        """Whether buffers of ``numel`` elements are pooled at all (also the size up to
        which a group keeps persistent sharded gradients, Note [persistent sharded
        gradients])."""
        return numel <= self.max_numel

    def pop(self, key: Hashable) -> B | None:
        """An idle buffer for ``key``, or None."""
        free = self._free.get(key)
        return free.pop() if free else None

    def push(self, key: Hashable, numel: int, buf: B) -> bool:
        """Keep ``buf`` (no longer in use) for ``key``; False if the rule drops it."""
        if not self.keeps(numel):
            return False
        free = self._free.setdefault(key, [])
        if len(free) >= self.max_per_key:
            return False
        free.append(buf)
        return True

    def idle(self) -> list[B]:
        return [b for free in self._free.values() for b in free]


class BufferPool(FreeLists[torch.Tensor]):
    """Free lists of flat buffers keyed by (numel, dtype, device)."""

    def __init__(self, max_numel: int = DEFAULT_MAX_NUMEL, max_per_key: int = 2):
        super().__init__(max_numel, max_per_key)
        self.allocations = 0  # buffers created (pool misses and unpooled sizes)

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        buf = self.pop((numel, dtype, device))
        if buf is None:
            self.allocations += 1
            buf = torch.empty(numel, dtype=dtype, device=device)
        return buf

    def idle_bytes(self) -> int:
        """Bytes held in the free lists (read-only accounting for fullshard.memory)."""
        return sum(b.numel() * b.element_size() for b in self.idle())

    def give(self, buf: torch.Tensor) -> None:
        """Return a buffer taken from this pool; it must no longer be in use."""
        self.push((buf.numel(), buf.dtype, buf.device), buf.numel(), buf)
