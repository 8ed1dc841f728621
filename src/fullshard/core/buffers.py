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

import torch

DEFAULT_MAX_NUMEL = 4 << 20  # 16 MiB of fp32


class BufferPool:
    """Free lists of flat buffers keyed by (numel, dtype, device)."""

    def __init__(self, max_numel: int = DEFAULT_MAX_NUMEL, max_per_key: int = 2):
        self.max_numel = max_numel
        self.max_per_key = max_per_key
        self._free: dict[tuple, list[torch.Tensor]] = {}
        self.allocations = 0  # buffers created (pool misses and unpooled sizes)

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        free = self._free.get((numel, dtype, device))
        if free:
            return free.pop()
        self.allocations += 1
        return torch.empty(numel, dtype=dtype, device=device)

    def idle_bytes(self) -> int:
        """Bytes held in the free lists (read-only accounting for fullshard.memory)."""
        return sum(b.numel() * b.element_size() for free in self._free.values() for b in free)

    def give(self, buf: torch.Tensor) -> None:
        """Return a buffer taken from this pool; it must no longer be in use."""
        if buf.numel() > self.max_numel:
            return
        free = self._free.setdefault((buf.numel(), buf.dtype, buf.device), [])
        if len(free) < self.max_per_key:
            free.append(buf)
