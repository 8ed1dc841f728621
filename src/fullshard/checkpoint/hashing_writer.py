"""torch DCP's file writer, with every file hashed as its bytes go out.

Note [checksums while writing]
The manifest's checksums (checksums.py) are computed from the bytes on their way to
the file, in the thread that writes them: DCP's ``FileSystemWriter`` opens every file
through its ``fs.create_stream``, and ``HashingFileSystem`` hands it a stream that
updates a hasher on each ``write``. No file is read back after the save, and on CUDA
the device-to-host copies DCP issues ahead of the writes (its overlapping loader) are
not held up by the hashing: it runs where the disk write runs, with XXH3 at memory
speed. What is recorded is checked, never trusted blindly: a stream that was sought
or used through any method the wrapper does not know records nothing, nor does one
whose byte count differs from the file's size when it is closed; ``unrecorded`` then
names the file and the commit hashes it by reading it back (also what happens to any
file DCP writes some other way, in some other torch version).
"""

from __future__ import annotations

import os
import threading
from contextlib import contextmanager
from typing import Any, Iterator

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import StorageMeta

from . import checksums
from .layout import WRITER_MARK


class HashingStream:
    """A binary file opened for writing that hashes what is written to it, in order."""

    def __init__(self, file: Any, algorithm: str):
        self._file = file
        self._hasher = checksums.new_hasher(algorithm)
        self.algorithm = algorithm
        self.written = 0
        self.in_order = True  # False once anything but a plain append happened

    def write(self, data: Any) -> int:
        # Called tens of times per tensor (torch.save writes its zip in small pieces): kept
        # to the two calls that matter. A buffered file writes all of ``data`` or raises;
        # both take any contiguous buffer as its raw bytes.
        n = self._file.write(data)
        self._hasher.update(data)
        self.written += n
        return n

    def tell(self) -> int:
        return self._file.tell()

    def seek(self, *args: Any) -> int:
        self.in_order = False  # a write after this may overwrite hashed bytes
        return self._file.seek(*args)

    def flush(self) -> None:
        self._file.flush()

    def fileno(self) -> int:
        return self._file.fileno()

    def writable(self) -> bool:
        return True

    def close(self) -> None:
        self._file.close()

    @property
    def closed(self) -> bool:
        return self._file.closed

    def __getattr__(self, name: str) -> Any:
        # Anything else (truncate, writelines, ...) goes to the file, and the digest no
        # longer counts: the file is hashed by reading it back instead.
        self.in_order = False
        return getattr(self._file, name)

    def entry(self, size_on_disk: int) -> dict | None:
        """The manifest entry of what was written, or None if it cannot be trusted."""
        if not self.in_order or self.written != size_on_disk:
            return None
        return checksums.entry(self.written, self.algorithm, self._hasher.hexdigest())


class HashingFileSystem(FileSystem):
    """DCP's local file system, whose written files are hashed on the way out; the
    entries are kept by file name (a checkpoint directory is flat)."""

    def __init__(self, algorithm: str):
        super().__init__()
        self.algorithm = algorithm
        self._entries: dict[str, dict] = {}
        self._lock = threading.Lock()  # DCP may write with several threads

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[Any]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        name = os.path.basename(os.fspath(path))
        self._forget(name)
        with open(path, mode) as file:  # buffered: see HashingStream.write
            stream = HashingStream(file, self.algorithm)
            yield stream
        recorded = stream.entry(os.path.getsize(path))  # closed: the size is final
        if recorded is not None:
            with self._lock:
                self._entries[name] = recorded

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        super().rename(path, new_path)
        with self._lock:
            moved = self._entries.pop(os.path.basename(os.fspath(path)), None)
            if moved is not None:
                self._entries[os.path.basename(os.fspath(new_path))] = moved

    def rm_file(self, path: str | os.PathLike) -> None:
        super().rm_file(path)
        self._forget(os.path.basename(os.fspath(path)))

    def _forget(self, name: str) -> None:
        with self._lock:
            self._entries.pop(name, None)

    def entries(self) -> dict[str, dict]:
        """File name -> manifest entry, for every file written through this object."""
        with self._lock:
            return dict(self._entries)


class HashingWriter(FileSystemWriter):
    """``FileSystemWriter`` (torch's defaults: one file per rank, fsync) whose files are
    hashed while written (Note [checksums while writing])."""

    def __init__(self, path: str | os.PathLike, algorithm: str):
        super().__init__(path)
        self.fs = HashingFileSystem(algorithm)

    def entries(self) -> dict[str, dict]:
        return self.fs.entries()

    def storage_meta(self) -> StorageMeta | None:
        # DCP's .metadata records that fullshard wrote it (layout.WRITER_MARK), so a
        # directory that lost its manifest is never read as torch's (verify.classify).
        meta = super().storage_meta() or StorageMeta()
        meta.modules = [*meta.modules, WRITER_MARK]
        return meta


def file_sizes(directory: str) -> dict[str, int]:
    """Name -> size of every file in ``directory``."""
    return {name: os.path.getsize(os.path.join(directory, name))
            for name in os.listdir(directory)}


def unrecorded(sizes: dict[str, int], entries: dict[str, dict]) -> list[str]:
    """Files (``sizes``: name -> size on disk) that no entry covers, or whose size
    changed since it was hashed: these are hashed by reading them back."""
    return sorted(name for name, size in sizes.items()
                  if name not in entries or entries[name]["bytes"] != size)
