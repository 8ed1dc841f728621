"""What CUDA's pinned host memory costs: the caching host allocator's block sizes.

Note [pinned host blocks]
A tensor made with ``pin_memory=True`` comes from torch's caching host allocator, which
rounds each request up to the next power of two (so that freed blocks serve later
requests of similar size) and keeps freed blocks for reuse. fullshard pins, where it
computes on CUDA with CPU offload, each unit's flat shard, its sharded gradients and
(the delayed update) its shard's copy: a 300 MB shard takes a 512 MB block, and a
model's host memory under offload can be up to twice the sum of its buffers. The
estimate counts each pinned buffer at its block's size. Since torch 2.10 the rounding
can be limited through the allocator's configuration (``PYTORCH_ALLOC_CONF`` or
``PYTORCH_CUDA_ALLOC_CONF``): requests above ``pinned_max_round_threshold_mb`` or
``pinned_max_cached_size_mb`` are taken at their own size. Optimizer states are made by
the optimizer (``zeros_like``), which does not pin: those are counted as they are.
"""

from __future__ import annotations

import os

CONF_VARIABLES = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
LIMITS = ("pinned_max_round_threshold_mb", "pinned_max_cached_size_mb")


def rounding_limit_bytes(environ=None) -> float:
    """The largest request the host allocator rounds up, from its configuration
    (unlimited where neither limit is set)."""
    environ = os.environ if environ is None else environ
    limit = float("inf")
    for variable in CONF_VARIABLES:
        for item in environ.get(variable, "").split(","):
            key, _, value = item.partition(":")
            if key.strip() in LIMITS:
                try:
                    limit = min(limit, float(value) * 2**20)
                except ValueError:  # torch refuses it when CUDA starts; nothing to count by
                    continue
    return limit


def pinned_block_bytes(nbytes: int, environ=None) -> int:
    """Bytes the caching host allocator takes for a pinned request of ``nbytes``."""
    if nbytes <= 0 or nbytes > rounding_limit_bytes(environ):
        return nbytes
    return 1 << (nbytes - 1).bit_length()
