"""The tensors of a folder of safetensors files (Hugging Face's layout: ``model.safetensors``,
or ``model-0000k-of-0000n.safetensors`` with ``model.safetensors.index.json``) or of one
``.safetensors`` file: which file holds each key, its shape and dtype, and reading part
of one. Each file is checked by ``safetensors.safe_open`` (its header, its offsets) and
then read with ``os.preadv`` (Note [reading rows into the shard]).

Note [reading rows into the shard]
A rank needs the rows ``[a, b)`` of each tensor that its shard covers, usually in
another dtype (bf16 files, fp32 shards). ``read(key, index, into=local)`` reads the
file's bytes of those rows only, straight into the destination when the dtypes match,
else a few MB of rows at a time into one scratch buffer that is cast into the
destination: each byte crosses from the page cache into the process once, the scratch
stays in the CPU's caches, and no page of the files is mapped into the process. A
mapping (the earlier reader) left every page read resident in the process until the end
(its RSS 1.6-1.7x its shards) and paid a page fault per 4 KB read. A block that takes
part of each row (a ``Shard(1)`` column block) reads its rows whole and keeps its part.
``bytes_read`` counts what was read, for the test that a rank reads only its rows.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass

import torch

from .layout import CheckpointError

INDEX = "model.safetensors.index.json"
_SCRATCH_BYTES = 4 << 20  # rows read per cast: a few MB stays in the CPU's caches
SUFFIX = ".safetensors"

# safetensors' dtype names (the header's "dtype" field)
DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


@dataclass(frozen=True)
class Stored:
    """One tensor of the files: the file that holds it, its shape and dtype name, and
    where its bytes begin in the file."""

    file: str
    shape: tuple[int, ...]
    dtype: str
    begin: int

    @property
    def torch_dtype(self) -> torch.dtype | None:
        return DTYPES.get(self.dtype)

    @property
    def nbytes(self) -> int:
        dtype = self.torch_dtype
        return math.prod(self.shape) * (dtype.itemsize if dtype is not None else 0)

    def rows(self, index: tuple[slice, ...] | None) -> tuple[int, int]:
        """The rows ``[a, b)`` of dim 0 that part ``index`` lies in (a 0-dim tensor is one
        row)."""
        if not self.shape:
            return 0, 1
        if index is None:
            return 0, self.shape[0]
        start, stop, _ = index[0].indices(self.shape[0])
        return start, max(start, stop)

    @property
    def row_bytes(self) -> int:
        return self.nbytes // self.shape[0] if self.shape and self.shape[0] else self.nbytes

    def byte_range(self, index: tuple[slice, ...] | None) -> tuple[int, int]:
        """The bytes of the file that part ``index`` lies in: its rows, whole."""
        first, last = self.rows(index)
        return self.begin + first * self.row_bytes, self.begin + last * self.row_bytes


class SafetensorsFiles:
    """Every tensor of the safetensors file or folder at ``path`` (CheckpointError naming
    the path when there is none, or when its index names a file that is not there).
    ``read`` opens each file once and keeps it open until ``close``."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.path.abspath(os.fspath(path))
        safetensors = _safetensors()
        self.files = _files(self.path)
        self.tensors: dict[str, Stored] = {}
        self._fds: dict[str, int] = {}
        self._scratch = torch.empty(0, dtype=torch.uint8)
        self.bytes_read = 0  # tensor bytes read from the files so far
        for file in self.files:
            with safetensors.safe_open(file, framework="pt"):
                pass  # safetensors checks the file's header and offsets as it opens it
            for key, stored in _header(file).items():
                if key in self.tensors:
                    raise CheckpointError(
                        f"load_hf: {key} is in both {self.tensors[key].file} and {file}; "
                        f"remove the copy that does not belong to {self.path}")
                self.tensors[key] = stored

    def read(self, key: str, index: tuple[slice, ...] | None = None,
             into: torch.Tensor | None = None) -> torch.Tensor:
        """The tensor ``key``, or its part ``index`` (one slice per leading dim), read
        from its file: into ``into`` (its shape, cast to its dtype) and returned, or into
        new memory in the stored dtype. Only the rows of the part are read (Note [reading
        rows into the shard])."""
        stored = self.tensors[key]
        dtype = stored.torch_dtype
        part = tuple(index[1:]) if index else ()
        first, last = stored.rows(index)
        if into is None:
            into = torch.empty(_shape_of(stored.shape, index), dtype=dtype)
        if into.numel() == 0:
            return into
        row = stored.row_bytes
        begin = stored.begin + first * row
        with torch.no_grad():
            destination = into.detach()
            if not part and into.dtype == dtype and destination.is_contiguous():
                self._pread(key, _bytes_of(destination), begin)  # no copy besides the read
                return into
            step = max(1, _SCRATCH_BYTES // row)
            for at in range(first, last, step):
                rows = min(step, last - at)
                scratch = self._scratch_of(rows * row)
                self._pread(key, scratch, begin + (at - first) * row)
                block = scratch.view(dtype).view((rows, *stored.shape[1:]) if stored.shape
                                                 else ())
                target = destination[at - first:at - first + rows] if stored.shape \
                    else destination
                target.copy_(block[(slice(None), *part)] if part else block)
        return into

    def _scratch_of(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` of the one scratch buffer, grown when a row needs more."""
        if self._scratch.numel() < nbytes:
            self._scratch = torch.empty(max(nbytes, _SCRATCH_BYTES), dtype=torch.uint8)
        return self._scratch[:nbytes]

    def _pread(self, key: str, buffer: torch.Tensor, offset: int) -> None:
        """Fill ``buffer`` (contiguous uint8) from ``offset`` of the file that holds ``key``."""
        file = self.tensors[key].file
        if file not in self._fds:
            self._fds[file] = os.open(file, os.O_RDONLY)
        view = memoryview(buffer.numpy()).cast("B")
        done = 0
        while done < len(view):  # one call reads at most about 2 GB
            n = os.preadv(self._fds[file], [view[done:]], offset + done)
            if n == 0:
                raise CheckpointError(f"load_hf: {file} ends before the bytes of {key} do "
                                      "(it changed after it was opened); copy the file again")
            done += n
        self.bytes_read += done

    def prefetch(self, blocks: list[tuple[str, tuple[slice, ...] | None]]) -> None:
        """Ask the kernel to start reading the bytes of ``blocks`` (key, part or None for
        all of it) into the page cache, so that the disk works while this process does
        other things (``posix_fadvise(WILLNEED)``; nothing where it does not exist)."""
        if not hasattr(os, "posix_fadvise"):
            return
        ranges: dict[str, list[tuple[int, int]]] = {}
        for key, index in blocks:
            stored = self.tensors[key]
            ranges.setdefault(stored.file, []).append(stored.byte_range(index))
        for file, spans in ranges.items():
            fd = os.open(file, os.O_RDONLY)
            try:
                for begin, end in _merged(spans):
                    os.posix_fadvise(fd, begin, end - begin, os.POSIX_FADV_WILLNEED)
            finally:
                os.close(fd)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self._scratch = torch.empty(0, dtype=torch.uint8)


def _shape_of(shape: tuple[int, ...], index: tuple[slice, ...] | None) -> tuple[int, ...]:
    """The shape of part ``index`` of a tensor of ``shape``."""
    if not index:
        return shape
    return tuple(len(range(*s.indices(n))) for s, n in zip(index, shape)) + shape[len(index):]


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous tensor, as a flat uint8 tensor sharing its memory."""
    return tensor.reshape(-1).view(torch.uint8) if tensor.dim() else \
        tensor.reshape(1).view(torch.uint8)


def _header(file: str) -> dict[str, Stored]:
    """Each tensor of the safetensors ``file``, from its header (8 bytes of length, then
    JSON with every tensor's dtype, shape and byte offsets after the header)."""
    with open(file, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    return {key: Stored(file, tuple(entry["shape"]), entry["dtype"],
                        8 + length + entry["data_offsets"][0])
            for key, entry in header.items() if key != "__metadata__"}


def _merged(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[list[int]] = []
    for begin, end in sorted(spans):
        if merged and begin <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([begin, end])
    return [(b, e) for b, e in merged]


def _safetensors():
    try:
        import safetensors
    except ImportError:
        raise CheckpointError("load_hf needs the safetensors package: pip install "
                              "'fullshard[hf]'") from None
    return safetensors


def _files(path: str) -> list[str]:
    """The safetensors files at ``path``: the file itself, the files the folder's index
    names, or else every ``*.safetensors`` file in the folder."""
    if os.path.isfile(path):
        if not path.endswith(SUFFIX):
            raise CheckpointError(f"load_hf: {path} is not a .safetensors file; give a "
                                  "Hugging Face model folder or one .safetensors file")
        return [path]
    if not os.path.isdir(path):
        raise CheckpointError(f"load_hf: no file or folder at {path}")
    index = os.path.join(path, INDEX)
    if os.path.isfile(index):
        try:
            with open(index) as f:
                names = sorted(set(json.load(f)["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            raise CheckpointError(f"load_hf: {index} cannot be read as an index of "
                                  f"safetensors files ({type(err).__name__}: {err})") from None
        _no_directories(path, names)
        missing = [n for n in names if not os.path.isfile(os.path.join(path, n))]
        if missing:
            raise CheckpointError(f"load_hf: {index} names {missing[0]}, which is not in "
                                  f"{path}; copy it there, or remove the index")
        return [os.path.join(path, n) for n in names]
    files = sorted(n for n in os.listdir(path) if n.endswith(SUFFIX))
    if not files:
        others = sorted(n for n in os.listdir(path) if n.endswith((".bin", ".pt", ".pth")))
        hint = (f" (it has {others[0]}: load it with from_pretrained and save it again "
                "with save_pretrained, which writes safetensors)") if others else ""
        raise CheckpointError(f"load_hf: {path} holds no .safetensors file{hint}")
    _no_directories(path, files)
    return [os.path.join(path, n) for n in files]


def _no_directories(path: str, names: list[str]) -> None:
    """A directory under a safetensors file's name is named as one (safetensors itself
    reports it as 'No such device')."""
    for name in names:
        if os.path.isdir(os.path.join(path, name)):
            raise CheckpointError(f"load_hf: {os.path.join(path, name)} is a directory, not a "
                                  f"{SUFFIX} file; put the file there, or remove the directory")
