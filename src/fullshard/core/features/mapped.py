"""Host tensors backed by a file, and giving their pages back after each use.

Note [parameters on disk]
``DiskOffloadPolicy(path=..., params=True)`` keeps a unit's flat shard (its sharded
parameters, the fp32 masters under CPU offload) in a file under ``path`` instead of in
host memory: the shard is a ``MAP_SHARED`` mapping of a file without a name
(``unnamed_file``), so it disappears with the process however the process ends. Every
reader (the gather's copy-in, the optimizer step, ``state_dict``, user code) sees an ordinary
tensor; the kernel reads its pages in on first touch.

What makes it offload is giving the pages back after each use: ``page_out`` asks the
kernel to write a range back and drop it (``MADV_PAGEOUT``, Linux 5.4), then drops the
process's mapping of whatever it passed over (``MADV_DONTNEED``: pages still in another
CPU's batch or under writeback; before 5.4 that is every page), which leaves the data in the
page cache. The group pages its shard out right after the copy-in of each gather (or, when
the collective sends the shard itself, once the gather is waited on), and after
sharding; the optimizer hook after the step (Note [optimizer states on disk]). Between
those points the shard costs the process no resident memory. The page cache may keep a
copy while the machine has free memory: it is the kernel's, not the process's, and is
dropped first under memory pressure.

Mapped memory cannot be pinned, so on CUDA the copy-in of such a unit is a pageable
host-to-device copy (synchronous for the host, as torch documents for pageable memory).
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import shutil
import tempfile

import torch

MADV_DONTNEED = 4
MADV_PAGEOUT = 21
_PAGE = mmap.PAGESIZE
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_pageout_works = True  # until the kernel says otherwise (EINVAL before Linux 5.4)


def reserve(fd: int, nbytes: int) -> OSError | None:
    """Claim the first ``nbytes`` of the file ``fd`` now (``posix_fallocate``; a file
    system without it is only extended), so a full disk shows here and not at a later
    write. Returns the error when the disk refused, else None."""
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            return e
        os.ftruncate(fd, nbytes)
    return None


def unnamed_file(directory: str, prefix: str) -> int:
    """A descriptor (read-write) of a new file in ``directory`` that has no name, so
    nothing is left behind however the process ends: the kernel frees its blocks when the
    last descriptor or mapping goes (``O_TMPFILE``; where the file system lacks it, a
    file named ``prefix...`` unlinked right after it is created)."""
    try:
        return os.open(directory, os.O_TMPFILE | os.O_RDWR, 0o600)
    except (AttributeError, OSError) as e:
        if isinstance(e, OSError) and e.errno not in (errno.EOPNOTSUPP, errno.EISDIR,
                                                      errno.EINVAL, errno.ENOENT):
            raise
    fd, path = tempfile.mkstemp(prefix=prefix, dir=directory)
    os.unlink(path)
    return fd


def reopen(fd: int, flags: int) -> int:
    """Another descriptor of the file ``fd`` (which may have no name) with its own
    ``flags`` (e.g. ``O_DIRECT``), through ``/proc/self/fd``."""
    return os.open(f"/proc/self/fd/{fd}", flags)


def mapped_empty(numel: int, dtype: torch.dtype, directory: str, label: str) -> torch.Tensor:
    """A 1-D CPU tensor of ``numel`` elements whose memory is a file under ``directory``
    (without a name: the mapping keeps it alive). The file's blocks are reserved now,
    so a full disk is an error here, not a crash at the first write."""
    nbytes = max(1, numel * torch.empty((), dtype=dtype).element_size())
    fd = unnamed_file(directory, "fullshard-params-")
    try:
        refused = reserve(fd, nbytes)
        if refused is not None:
            free = shutil.disk_usage(directory).free
            raise RuntimeError(
                f"fully_shard({label}): DiskOffloadPolicy(path={directory!r}, params=True): "
                f"cannot reserve {nbytes / 2**20:.1f} MiB for the unit's parameters "
                f"({refused.strerror}; {free / 2**20:.1f} MiB free there). Free space on that "
                "disk or name a larger one.")
        mapping = mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)
    # frombuffer keeps ``mapping`` alive for as long as the tensor's storage lives
    return torch.frombuffer(mapping, dtype=dtype, count=numel)


def page_out(t: torch.Tensor) -> None:
    """Write back and drop the pages under ``t`` (a view of a ``mapped_empty`` tensor;
    neighbouring bytes on the same pages go too, and come back on their next touch)."""
    global _pageout_works
    if t.numel() == 0:
        return
    start = t.data_ptr()
    end = start + t.numel() * t.element_size()
    first = start - start % _PAGE
    length = end - first
    if _pageout_works and _libc.madvise(first, length, MADV_PAGEOUT) != 0:
        if ctypes.get_errno() == errno.EINVAL:
            _pageout_works = False  # a kernel before 5.4: drop the mapping, keep the data
    # MADV_PAGEOUT passes over pages it cannot take off the LRU lists now: a page that
    # another thread faulted in (torch's intra-op threads, on another CPU) waits in that
    # CPU's batch of pages not yet on a list, and a page already being written back is
    # left too. Dropping the mapping takes whatever is left out of the process (the page
    # cache keeps it, dirty data included, until the kernel writes and reclaims it)
    _libc.madvise(first, length, MADV_DONTNEED)


def resident_bytes() -> int:
    """This process's resident memory (bytes, from /proc: anonymous and file-backed)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE
