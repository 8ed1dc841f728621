"""StateFiles: one rank's optimizer-state files on disk, read and written by one I/O thread.

Each state name (``exp_avg``, ``exp_avg_sq``, ...) has a file laid out as a flat array
over every disk-offloaded element of the optimizer, in the order the chunks give; chunk
``c`` is the extent ``extents[c]`` (first element, elements) of each file, at most
``chunk_numel`` long and starting on an ALIGN-element boundary. Reads and writes go
through staging buffers: ``SETS`` sets of one aligned host buffer per state name, chunk
``c`` using set ``c % SETS`` (Note [optimizer states on disk] says why three).

One I/O thread runs the reads and writes in the order they are submitted. That order is
what makes reusing a set safe: the read that refills a set is always submitted after the
write that empties it. ``os.preadv``/``os.pwritev`` release the GIL, so the thread's disk
time overlaps the optimizer's arithmetic and, after the step, the next forward.

Files are opened with ``O_DIRECT`` where the file system allows it (the page cache
would otherwise hold a second copy of every state in host memory, which is what the
offload is for removing); buffers and offsets are 4096-byte aligned for it. Where
``O_DIRECT`` is refused (tmpfs, some network file systems) the files are buffered.

The files have no name (core/features/mapped.unnamed_file): only this process's descriptors hold
them, so however it ends (closed with its optimizer, at exit, killed by a signal or the
out-of-memory killer) the kernel frees their blocks and nothing is left under the path.
A job restarted after a crash, however often, finds the disk as it was.
"""

from __future__ import annotations

import errno
import os
import shutil
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from ..core.features.mapped import reopen, reserve, unnamed_file

ALIGN = 4096   # bytes: O_DIRECT's alignment for buffers, offsets and lengths
SETS = 3       # staging sets: one read ahead, one stepping, one being written back


def _aligned_empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A 1-D host tensor of ``numel`` elements whose first byte is ALIGN-aligned."""
    item = torch.empty((), dtype=dtype).element_size()
    raw = torch.empty(numel * item + ALIGN, dtype=torch.uint8)
    skip = (-raw.data_ptr()) % ALIGN
    return raw[skip:skip + numel * item].view(dtype)


def _as_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.view(torch.uint8).numpy())


def _transfer(write: bool, jobs: list[tuple[int, memoryview, int]]) -> tuple[int, float]:
    """Write (or read) each ``(fd, bytes, offset)`` whole; the bytes moved and the
    seconds it took."""
    began = time.perf_counter()
    moved = 0
    for fd, view, at in jobs:
        done = 0
        while done < len(view):
            n = (os.pwritev if write else os.preadv)(fd, [view[done:]], at + done)
            if n <= 0:
                raise OSError(errno.EIO, "the file ended early" if not write else "short write")
            done += n
        moved += done
    return moved, time.perf_counter() - began


def _close(fds: dict, io: ThreadPoolExecutor) -> None:
    io.shutdown(wait=True)
    for fd in list(fds.values()):
        os.close(fd)  # the files have no name: the last descriptor frees their blocks
    fds.clear()


class StateFiles:
    """The files under one ``DiskOffloadPolicy.path`` for one optimizer on one rank."""

    def __init__(self, path: str, extents: list[tuple[int, int]], chunk_numel: int,
                 label: str):
        self.label = label                    # names the policy in errors
        self.chunk_numel = chunk_numel        # staging buffer elements (a multiple of ALIGN)
        # each chunk's (first element, elements) in the files, both multiples of ALIGN:
        # O_DIRECT transfers whole aligned blocks, so a short chunk moves its rounded size
        self.extents = [(start, min(chunk_numel, -(-numel // ALIGN) * ALIGN))
                        for start, numel in extents] or [(0, chunk_numel)]
        self.capacity = max(start + numel for start, numel in self.extents)  # per file
        self.directory = path                 # where the (unnamed) files are
        self.direct = hasattr(os, "O_DIRECT")
        self._fds: dict[str, int] = {}         # state name -> fd (O_DIRECT where allowed)
        self._plain: dict[str, int] = {}       # state name -> buffered fd (unaligned reads)
        self._opened: dict[str, int] = {}      # every descriptor, for the finalizer to close
        self.dtypes: dict[str, torch.dtype] = {}
        self.sets: list[dict[str, torch.Tensor]] = [{} for _ in range(SETS)]
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fullshard-disk")
        self._pending: dict[Future, str] = {}  # queued transfers -> "reading" / "writing"
        self._last: dict[int, Future] = {}     # staging set -> the last transfer queued on it
        self.bytes_read = 0
        self.bytes_written = 0
        self.io_seconds = 0.0  # the I/O thread's time in reads and writes that were waited on
        # The files go when this object does, at interpreter exit, or with the process.
        self._finalizer = weakref.finalize(self, _close, self._opened, self._io)

    # -- files and buffers -------------------------------------------------------------

    def ensure(self, name: str, dtype: torch.dtype) -> None:
        """Create the file and staging buffers of state ``name`` on its first use."""
        if name in self._fds:
            if self.dtypes[name] != dtype:
                raise RuntimeError(
                    f"fullshard: {self.label}: optimizer state '{name}' changed dtype from "
                    f"{self.dtypes[name]} to {dtype}; states on disk keep one dtype per name.")
            return
        nbytes = self.capacity * torch.empty((), dtype=dtype).element_size()
        plain = unnamed_file(self.directory, f"fullshard-optim-{name}-")
        self._plain[name] = self._opened[f"{name}:plain"] = plain
        fd = plain
        if self.direct:
            try:
                fd = self._opened[name] = reopen(plain, os.O_RDWR | os.O_DIRECT)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                self.direct = False
        self._fds[name] = fd
        self._reserve(fd, nbytes, name)
        self.dtypes[name] = dtype
        for staged in self.sets:
            staged[name] = _aligned_empty(self.chunk_numel, dtype)

    def _reserve(self, fd: int, nbytes: int, name: str) -> None:
        """Claim the file's bytes now, so a full disk stops the first step with a clear
        error instead of a write failing halfway through a later one."""
        refused = reserve(fd, nbytes)
        if refused is not None:
            free = shutil.disk_usage(self.directory).free
            raise RuntimeError(
                f"fullshard: {self.label}: cannot reserve {nbytes / 2**20:.1f} MiB for "
                f"optimizer state '{name}' in {self.directory} ({refused.strerror}; "
                f"{free / 2**20:.1f} MiB free there). Free space on that disk or name a "
                "larger one in DiskOffloadPolicy(path=...).")

    @property
    def staging_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for s in self.sets for t in s.values())

    def staged(self, chunk: int) -> dict[str, torch.Tensor]:
        return self.sets[chunk % SETS]

    # -- asynchronous chunk I/O --------------------------------------------------------

    def _offset(self, name: str, element: int) -> int:
        return element * self.sets[0][name].element_size()

    def submit(self, write: bool, chunk: int) -> Future:
        """Queue the write (from) or read (into) staging set ``chunk % SETS`` of every
        state file; the caller waits on the future before touching that set again."""
        staged = self.staged(chunk)
        start, numel = self.extents[chunk]
        jobs = [(self._fds[name], _as_bytes(staged[name][:numel]), self._offset(name, start))
                for name in self._fds]
        # a plain function: the I/O thread must hold no reference to this object (the
        # last one dropped there would run the finalizer on the thread it joins)
        future = self._io.submit(_transfer, write, jobs)
        self._pending[future] = "writing" if write else "reading"
        self._last[chunk % SETS] = future
        return future

    def claim(self, chunk: int) -> dict[str, torch.Tensor]:
        """Staging set ``chunk % SETS``, once every transfer queued on it so far is done
        (the read that fills it, or the write that last emptied it; earlier transfers
        first, so a failed write is reported before the read that follows it)."""
        last = self._last.pop(chunk % SETS, None)
        if last is not None:
            for future in list(self._pending):
                self.wait(future)
                if future is last:
                    break
        return self.staged(chunk)

    def wait(self, future: Future | None) -> None:
        if future is None:
            return
        doing = self._pending.pop(future, "reading")
        try:
            moved, seconds = future.result()
            self.io_seconds += seconds
            if doing == "writing":
                self.bytes_written += moved
            else:
                self.bytes_read += moved
        except OSError as e:
            raise RuntimeError(
                f"fullshard: {self.label}: {doing} optimizer states in {self.directory} "
                f"failed: {e.strerror or e}. Check the disk (space, permissions, health) named "
                "in DiskOffloadPolicy(path=...).") from None

    def drain(self) -> None:
        """Wait for every queued read and write (before reading files outside the pipeline)."""
        for future in list(self._pending):
            self.wait(future)
        self._last.clear()

    def read_range(self, name: str, start: int, numel: int) -> torch.Tensor:
        """Elements ``[start, start + numel)`` of state ``name``, read synchronously into a
        new tensor (state_dict; unaligned, so through the buffered descriptor)."""
        self.drain()
        out = torch.empty(numel, dtype=self.dtypes[name])
        view = _as_bytes(out)
        at = self._offset(name, start)
        done = 0
        while done < len(view):
            n = os.preadv(self._plain[name], [view[done:]], at + done)
            if n <= 0:
                raise RuntimeError(f"fullshard: {self.label}: optimizer state '{name}' in "
                                   f"{self.directory} is shorter than expected.")
            done += n
        return out

    def close(self) -> None:
        self._finalizer()
