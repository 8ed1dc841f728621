"""An opt-in CPU allocator policy for sharded training: ``tune_cpu_allocator()``.

Note [glibc's mmap threshold on CPU]
Sharded training allocates and frees the same large buffers every step (gathered
parameters, gradient buckets, collective buffers). glibc serves blocks below its
mmap threshold from the heap, and by default that threshold grows to 32 MiB after
the first large free; freed heap blocks stay resident and fragment, so peak RSS
sits far above live memory (W3: 2.9 GiB peak for ~2.1 GiB live). With the
threshold fixed at 4 MiB every larger block is mapped and returned on free: W3's
peak fell from 2.99 to 2.72 GiB. The price is paid in page faults: a gathered
unit above 4 MiB is mapped afresh at every gather (W1: ~15% slower steps than
with glibc's default; 16 MiB kept W1's speed but W3 peaked at 2.95 GiB). On CUDA
none of this applies (the caching allocator reuses device memory).

The setting belongs to the whole process (every library's allocations follow it),
so fullshard never applies it by itself: a program calls ``tune_cpu_allocator()``
once at start when it wants the lower peak, and ``fullshard train`` does so on CPU.
fullshard's memory estimate for the CPU assumes it (memory/activations.py).
"""

from __future__ import annotations

import ctypes
import ctypes.util

M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 4 << 20


def tune_cpu_allocator(mmap_threshold_bytes: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Fix glibc's mmap threshold for this whole process (see the note above): blocks
    of at least ``mmap_threshold_bytes`` are mapped and given back to the system when
    freed. Returns whether it was applied (False where the C library is not glibc)."""
    if not isinstance(mmap_threshold_bytes, int) or mmap_threshold_bytes <= 0:
        raise ValueError("tune_cpu_allocator: mmap_threshold_bytes must be a positive int, "
                         f"got {mmap_threshold_bytes!r}.")
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS): leave the allocator alone
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return bool(mallopt(M_MMAP_THRESHOLD, mmap_threshold_bytes))


def release_free_heap() -> bool:
    """Give the heap's free pages back to the system (glibc's ``malloc_trim``), anywhere
    in the heap, not only at its top. Worth a call once after building a model on the
    CPU and sharding it: the whole model's tensors below the mmap threshold were served
    from the heap, and once the shards replace them their pages would otherwise stay
    resident for the rest of the run. Returns whether anything was released (False
    where the C library is not glibc)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes = [ctypes.c_size_t]
    return bool(trim(0))
