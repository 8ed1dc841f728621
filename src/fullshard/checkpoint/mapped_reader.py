"""torch DCP's file reader, with tensors copied straight out of a memory map of each file.

Note [reading tensors out of a memory map]
DCP's ``FileSystemWriter`` writes every tensor of a rank's file as one ``torch.save``
archive (an uncompressed zip: a small pickle naming the storage, dtype, size and
strides, then the storage's bytes), one after another. Its ``FileSystemReader`` reads
each back with ``torch.load`` of a view of the file: for a checkpoint of a few hundred
tensors most of the load's time goes into Python (torch's weights-only unpickler, about
a millisecond a tensor, and the zip reader's small reads), then two copies (the file
into a new storage, that storage into the destination). ``MappedReader`` maps each file
it reads once, finds each archive's storage from the zip's central directory, reads the
pickle with a restricted unpickler that knows only a plain tensor (a storage, its dtype,
offset, size and strides; anything else is refused), and copies the requested region
from the mapping into the destination: one copy, from the page cache. Whatever does not
look exactly like that (a transform extension, bytes rather than a tensor, a zip64 or
compressed record, a big-endian archive, a tensor subclass, an empty storage) is read
by DCP's own code path, so what is loaded never depends on the fast path's guesses.
No library reads one record of a zip held in memory without copying it (``zipfile``
reads through a file object), hence the few lines of zip parsing here.
"""

from __future__ import annotations

import collections
import functools
import io
import mmap
import os
import pickle
import struct
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

_EOCD = struct.Struct("<4sHHHHIIH")           # end of central directory, 22 bytes
_CENTRAL = struct.Struct("<4s6HIIIHHHHHII")    # a central directory entry, 46 bytes
_LOCAL = struct.Struct("<4s5HIIIHH")           # a local file header, 30 bytes
_ZIP64 = 0xFFFFFFFF


@dataclass(frozen=True)
class _Stored:
    """Where a ``torch.save`` archive keeps its one tensor: the storage's bytes at
    ``offset`` in the file, and the tensor's view of them."""

    offset: int
    dtype: torch.dtype
    numel: int
    storage_offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


class MappedReader(FileSystemReader):
    """``FileSystemReader`` that copies tensors out of a memory map of each file (Note
    [reading tensors out of a memory map]) and reads ``.metadata`` once per load (both
    fullshard's checks and DCP ask for it: a pickle of every item)."""

    def __init__(self, path: str | os.PathLike):
        super().__init__(path)
        self._metadata = None

    def read_metadata(self, *args: Any, **kwargs: Any):
        if args or kwargs:  # a rank's own metadata (checkpoints saved without collectives)
            return super().read_metadata(*args, **kwargs)
        if self._metadata is None:
            self._metadata = super().read_metadata()
        return self._metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path,
                                []).append(item)
        left: list[ReadItem] = []
        for relative_path, items in per_file.items():
            left += self._read_file(os.path.join(self.path, relative_path), items, planner)
        if left:  # DCP's own path for what the mapping does not serve
            super().read_data(LoadPlan(left, plan.storage_data, plan.planner_data), planner)
        done: Future = Future()
        done.set_result(None)
        return done

    def _read_file(self, path: str, items: list[ReadItem], planner: LoadPlanner
                   ) -> list[ReadItem]:
        """Copy every tensor of ``items`` it can out of the file at ``path``; returns
        the items left for DCP's reader."""
        left = []
        with open(path, "rb") as file:
            size = os.fstat(file.fileno()).st_size
            if size == 0:
                return items
            # ACCESS_COPY: private pages, so torch.frombuffer gets a writable buffer
            # (nothing writes to it; the file cannot change through it).
            mapped = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_COPY)
        view = memoryview(mapped)
        try:
            for item in sorted(items, key=lambda i: self.storage_data[i.storage_index].offset):
                if not self._copy_item(mapped, view, item, planner):
                    left.append(item)
        finally:
            view.release()
            try:
                mapped.close()
            except BufferError:  # a tensor of an error's traceback still views it
                pass
        return left

    def _copy_item(self, mapped: mmap.mmap, view: memoryview, item: ReadItem,
                   planner: LoadPlanner) -> bool:
        info = self.storage_data[item.storage_index]
        if item.type == LoadItemType.BYTE_IO or getattr(info, "transform_descriptors", None):
            return False
        stored = locate(view, info.offset, info.length)
        if stored is None:
            return False
        source = torch.frombuffer(mapped, dtype=stored.dtype, count=stored.numel,
                                  offset=stored.offset)
        if stored.storage_offset or stored.stride != _contiguous_strides(stored.size):
            source = source.as_strided(stored.size, stored.stride, stored.storage_offset)
        else:
            source = source.view(stored.size)
        for dim, (start, length) in enumerate(zip(item.storage_offsets, item.lengths)):
            if (start, length) != (0, source.shape[dim]):
                source = source.narrow(dim, start, length)
        target = planner.resolve_tensor(item).detach()
        if target.shape != source.shape:
            raise AssertionError(f"req {item.storage_index} mismatch sizes {target.size()} "
                                 f"vs {source.size()}")  # DCP's own message
        target.copy_(source)
        del source
        planner.commit_tensor(item, target)
        return True


def locate(view: memoryview, start: int, length: int) -> _Stored | None:
    """The tensor of the ``torch.save`` archive at ``view[start:start + length]``, or
    None when the archive holds anything but one plain little-endian tensor stored
    uncompressed (its reader is then torch.load)."""
    try:
        records = _records(view, start, length)
        pickled = records.get("data.pkl")
        if pickled is None or bytes(view[slice(*records.get("byteorder", (0, 0)))]) \
                not in (b"", b"little"):
            return None
        key, dtype, numel, storage_offset, size, stride = _unpickle_tensor(
            bytes(view[pickled[0]:pickled[1]]))
        data = records.get(f"data/{key}")
    except (ValueError, KeyError, IndexError, TypeError, struct.error, pickle.UnpicklingError,
            _NotPlain):
        return None
    if data is None or numel == 0 or data[1] - data[0] != numel * dtype.itemsize:
        return None
    if any(n < 0 for n in size) or any(s < 0 for s in stride) or storage_offset < 0:
        return None
    last = storage_offset + sum((n - 1) * s for n, s in zip(size, stride))
    if 0 in size or last >= numel:
        return None
    return _Stored(data[0], dtype, numel, storage_offset, tuple(size), tuple(stride))


def _records(view: memoryview, start: int, length: int) -> dict[str, tuple[int, int]]:
    """Record name (without the archive's folder) -> (begin, end) of its bytes in
    ``view``, for an uncompressed zip at ``view[start:start + length]`` without zip64."""
    end = start + length
    (sig, _, _, _, count, cd_size, cd_offset, comment) = _EOCD.unpack_from(view, end - 22)
    if sig != b"PK\x05\x06" or comment or cd_offset == _ZIP64 or count == 0xFFFF:
        raise ValueError("not a plain zip")
    records = {}
    at = start + cd_offset
    for _ in range(count):
        (sig, _, _, _, method, _, _, _, packed, unpacked, name_len, extra_len, note_len,
         _, _, _, local) = _CENTRAL.unpack_from(view, at)
        if sig != b"PK\x01\x02" or method != 0 or packed != unpacked or _ZIP64 in (
                packed, local):
            raise ValueError("a record that is not stored plainly")
        name = bytes(view[at + 46:at + 46 + name_len]).decode("utf-8")
        at += 46 + name_len + extra_len + note_len
        header = start + local
        (sig, *_, l_name, l_extra) = _LOCAL.unpack_from(view, header)
        if sig != b"PK\x03\x04":
            raise ValueError("bad local header")
        begin = header + 30 + l_name + l_extra
        if begin + packed > end:
            raise ValueError("a record past the archive's end")
        records[name.partition("/")[2]] = (begin, begin + packed)
    return records


class _NotPlain(Exception):
    """The pickle holds something other than one plain tensor."""


class _TensorUnpickler(pickle.Unpickler):
    """Reads ``torch.save``'s pickle of one plain tensor into its parts; any other global
    is refused (nothing is built or called but these tuples)."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _tensor_parts
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if module == "torch" and name.endswith("Storage"):
            return _storage_dtype(name)
        raise _NotPlain(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"
                and isinstance(pid[1], torch.dtype)):
            raise _NotPlain("storage")
        return (pid[2], pid[1], pid[4])  # key, dtype, numel


def _tensor_parts(storage, storage_offset, size, stride, requires_grad, hooks,
                  metadata=None):
    if hooks or metadata:
        raise _NotPlain("hooks or metadata")
    return (*storage, storage_offset, tuple(size), tuple(stride))


def _unpickle_tensor(data: bytes) -> tuple:
    parts = _TensorUnpickler(io.BytesIO(data)).load()
    if not (isinstance(parts, tuple) and len(parts) == 6):
        raise _NotPlain("not a tensor")
    return parts


def _contiguous_strides(size: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(size):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


@functools.lru_cache(maxsize=None)
def _storage_dtype(name: str) -> torch.dtype:
    """The dtype of the legacy storage class ``torch.<name>`` that torch.save names."""
    cls = getattr(torch, name, None)
    with warnings.catch_warnings():  # "TypedStorage is deprecated"
        warnings.simplefilter("ignore")
        dtype = getattr(cls, "dtype", None)
    if not isinstance(dtype, torch.dtype):
        raise _NotPlain(name)
    return dtype
