"""The tensors of a folder of safetensors files (Hugging Face's layout: ``model.safetensors``,
or ``model-0000k-of-0000n.safetensors`` with ``model.safetensors.index.json``) or of one
``.safetensors`` file: which file holds each key, its shape and dtype, and reading part
of one. Each file is checked by ``safetensors.safe_open`` (its header, its offsets) and
then memory-mapped: ``read`` returns a view of the mapping (no copy), so copying rows
``[a, b)`` of a tensor into a shard reads only those bytes of the file, straight from the
page cache into the shard.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
from dataclasses import dataclass

import torch

from .layout import CheckpointError

INDEX = "model.safetensors.index.json"
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

    def byte_range(self, index: tuple[slice, ...] | None) -> tuple[int, int]:
        """The bytes of the file that part ``index`` lies in: its rows when it takes
        whole rows of dim 0, else the whole tensor's."""
        row = self.nbytes // self.shape[0] if self.shape and self.shape[0] else 0
        whole_rows = index is not None and all(
            (s.start, s.stop) == (0, n) for s, n in zip(index[1:], self.shape[1:]))
        if not whole_rows:
            return self.begin, self.begin + self.nbytes
        return self.begin + index[0].start * row, self.begin + index[0].stop * row


class SafetensorsFiles:
    """Every tensor of the safetensors file or folder at ``path`` (CheckpointError naming
    the path when there is none, or when its index names a file that is not there).
    ``read`` maps each file once and keeps it mapped until ``close``."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.path.abspath(os.fspath(path))
        safetensors = _safetensors()
        self.files = _files(self.path)
        self.tensors: dict[str, Stored] = {}
        self._mapped: dict[str, mmap.mmap] = {}
        for file in self.files:
            with safetensors.safe_open(file, framework="pt"):
                pass  # safetensors checks the file's header and offsets as it opens it
            for key, stored in _header(file).items():
                if key in self.tensors:
                    raise CheckpointError(
                        f"load_hf: {key} is in both {self.tensors[key].file} and {file}; "
                        f"remove the copy that does not belong to {self.path}")
                self.tensors[key] = stored

    def _mapping(self, file: str) -> mmap.mmap:
        if file not in self._mapped:
            with open(file, "rb") as f:
                # ACCESS_COPY: private pages, so torch.frombuffer gets a writable buffer
                # (nothing writes to it; the file cannot change through it).
                self._mapped[file] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        return self._mapped[file]

    def read(self, key: str, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        """The tensor ``key``, or its part ``index`` (one slice per leading dim), as a
        view of its memory-mapped file: only the bytes that are copied out of it are read.
        Valid until ``close``."""
        stored = self.tensors[key]
        count = math.prod(stored.shape)
        if count == 0:
            whole = torch.empty(stored.shape, dtype=stored.torch_dtype)
        else:
            whole = torch.frombuffer(self._mapping(stored.file), dtype=stored.torch_dtype,
                                     count=count, offset=stored.begin).view(stored.shape)
        return whole[index] if index else whole

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
        for mapped in self._mapped.values():
            try:
                mapped.close()
            except BufferError:  # a view is still held (an error's traceback): left to it
                pass
        self._mapped.clear()


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
