"""Inspect a checkpoint, and export its model to one ``.safetensors`` file or to
Hugging Face's sharded layout (several files and an index).

Both run in one process with no process group. Export streams: it writes the
safetensors header from the checkpoint's metadata first, then reads and appends
one tensor at a time (DCP reads only the pieces of that tensor from the shard
files), so its peak memory is about the largest tensor, not the model. A sharded export
writes its files one after another the same way.
"""

from __future__ import annotations

import json
import os
import re
import struct
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from . import torch_dcp
from .io import _read_into
from .layout import EXTRA, CheckpointError
from .verify import Checkpoint, failure, open_checkpoint, read_extra, verify_files

_SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}


def _model_prefix(meta: dict[str, Any]) -> str:
    """``model.`` (fullshard's layout, and torch's recipe); a checkpoint torch's DCP wrote
    of ``model.state_dict()`` alone has its tensors at the top level."""
    return torch_dcp.MODEL if any(k.startswith(torch_dcp.MODEL) for k in meta) else ""


def model_tensors(path: str) -> dict[str, TensorStorageMetadata]:
    """Model tensor name (without the ``model.`` prefix) -> its DCP metadata. Read only
    from a checkpoint that ``open_checkpoint`` returned."""
    meta = FileSystemReader(path).read_metadata().state_dict_metadata
    prefix = _model_prefix(meta)
    return {k[len(prefix):]: v for k, v in meta.items()
            if k.startswith(prefix) and isinstance(v, TensorStorageMetadata)
            and not (prefix == "" and k.startswith(torch_dcp.OPTIM))}


def inspect(path: str | os.PathLike, verify: bool = True) -> dict[str, Any]:
    """What a checkpoint holds: world size, extra, and each model tensor's shape,
    dtype and bytes; with ``verify`` also whether every file matches its checksum. A
    checkpoint that fails verification is described from its manifest alone (its
    ``extra`` is not read); one torch's DCP wrote from its metadata, world size unknown."""
    checkpoint = open_checkpoint(path, verify=False, collective=False)
    manifest = checkpoint.manifest
    if manifest is None:
        tensors = {name: {"shape": list(m.size), "dtype": _dtype_name(m.properties.dtype)}
                   for name, m in model_tensors(checkpoint.path).items()}
        status, failed = "none (a torch DCP checkpoint without a manifest: unverified)", False
        if verify:
            try:
                _read_every_tensor(checkpoint)
                status = ("none (a torch DCP checkpoint without a manifest: unverified; "
                          "every tensor read back, but a changed byte would go unnoticed)")
            except CheckpointError as err:
                status, failed = str(err), True
        return _described(checkpoint.path, tensors, world_size=None, has_optimizer=None,
                          status=status, extra=None, failed=failed,
                          nbytes=_directory_bytes(checkpoint.path))
    status = "not checked"
    if verify:
        try:
            verify_files(checkpoint.path, manifest["files"], collective=False)
            status = "ok"
        except CheckpointError as err:
            status = str(err)
    failed = verify and status != "ok"
    extra = None if failed else _extra(checkpoint)
    return _described(checkpoint.path, manifest["tensors"], manifest["world_size"],
                      manifest.get("has_optimizer", False), status, extra,
                      sum(f["bytes"] for f in manifest["files"].values()), failed)


def _read_every_tensor(checkpoint: Checkpoint) -> None:
    """Read each tensor of a checkpoint without checksums (one at a time: the largest
    tensor's memory), so a file cut short or unreadable is found; a changed byte is not."""
    reader = FileSystemReader(checkpoint.path)
    for key, m in reader.read_metadata().state_dict_metadata.items():
        if isinstance(m, TensorStorageMetadata):
            _read_into(checkpoint, {key: torch.empty(m.size, dtype=m.properties.dtype)},
                       FileSystemReader(checkpoint.path), collective=False)


def _extra(checkpoint: Checkpoint) -> Any:
    try:
        return read_extra(checkpoint)
    except Exception as err:  # noqa: BLE001 - only reached unverified (--no-verify)
        raise CheckpointError(f"{os.path.join(checkpoint.path, EXTRA)} cannot be read "
                              f"({failure(err)}); inspect it without --no-verify to find the "
                              "damaged file") from None


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _described(path: str, tensors: dict[str, dict], world_size: int | None,
               has_optimizer: bool | None, status: str, extra: Any, nbytes: int,
               failed: bool) -> dict[str, Any]:
    return {"path": path, "world_size": world_size, "has_optimizer": has_optimizer,
            "checksums": status, "failed": failed, "extra": extra, "bytes": nbytes,
            "tensors": {name: {"shape": list(t["shape"]), "dtype": t["dtype"],
                               "numel": _numel(t["shape"]),
                               "bytes": _numel(t["shape"]) * _itemsize(t["dtype"])}
                        for name, t in tensors.items()}}


def _numel(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _itemsize(dtype_name: str) -> int:
    dtype = getattr(torch, dtype_name, None)
    return dtype.itemsize if isinstance(dtype, torch.dtype) else 0


def _directory_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path)
               if os.path.isfile(os.path.join(path, n)))


@dataclass(frozen=True)
class ExportedTensor:
    """One tensor of an export: its name there, the checkpoint tensor it is read from
    (without the ``model.`` prefix), and whether its two dimensions are swapped."""

    name: str
    source: str
    transpose: bool = False


def export_safetensors(path: str | os.PathLike, out: str | os.PathLike) -> str:
    """Write the checkpoint's model tensors, unsharded, to one ``.safetensors`` file."""
    checkpoint = open_checkpoint(path, collective=False)
    tensors = model_tensors(checkpoint.path)
    out = os.fspath(out)
    _write_file(checkpoint, out, [ExportedTensor(name, name) for name in tensors], tensors)
    return out


SINGLE_FILE = "model.safetensors"
INDEX = "model.safetensors.index.json"
_SHARD_FILE = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")


def export_sharded(path: str | os.PathLike | Checkpoint, out_dir: str | os.PathLike,
                   entries: list[ExportedTensor], max_shard_bytes: int) -> list[str]:
    """Write ``entries`` in Hugging Face's layout: ``model.safetensors`` when they fit in
    ``max_shard_bytes``, else ``model-0000k-of-0000n.safetensors`` files of at most that
    size (a larger tensor gets a file of its own) and ``model.safetensors.index.json``
    mapping each name to its file. Files of an earlier export in ``out_dir`` that this one
    does not rewrite are removed. Returns the files written. ``path`` may be a checkpoint
    ``open_checkpoint`` returned already (not verified twice)."""
    checkpoint = path if isinstance(path, Checkpoint) else open_checkpoint(path,
                                                                           collective=False)
    path = checkpoint.path
    tensors = model_tensors(path)
    missing = [e.source for e in entries if e.source not in tensors]
    if missing:
        raise CheckpointError(f"export: checkpoint {path} has no model tensor "
                              f"{', '.join(missing[:5])}; it is not a checkpoint of this model")
    shards: list[list[ExportedTensor]] = [[]]
    filled = 0
    for entry in entries:
        nbytes = _nbytes(tensors[entry.source])
        if shards[-1] and filled + nbytes > max_shard_bytes:
            shards.append([])
            filled = 0
        shards[-1].append(entry)
        filled += nbytes
    out_dir = os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    names = [SINGLE_FILE] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for name in os.listdir(out_dir):  # an earlier export's files would mislead a loader
        if (name in (SINGLE_FILE, INDEX) or _SHARD_FILE.match(name)) and name not in names:
            os.remove(os.path.join(out_dir, name))
    written = []
    for name, shard in zip(names, shards):
        written.append(_write_file(checkpoint, os.path.join(out_dir, name), shard, tensors))
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(_nbytes(tensors[e.source]) for e in entries)},
                 "weight_map": {e.name: name for name, shard in zip(names, shards)
                                for e in shard}}
        with open(os.path.join(out_dir, INDEX + ".partial"), "w") as f:
            json.dump(index, f, indent=2)
        os.replace(os.path.join(out_dir, INDEX + ".partial"), os.path.join(out_dir, INDEX))
        written.append(os.path.join(out_dir, INDEX))
    return written


def _nbytes(m: TensorStorageMetadata) -> int:
    return m.size.numel() * m.properties.dtype.itemsize


def _write_file(checkpoint: Checkpoint, out: str, entries: list[ExportedTensor],
                tensors: dict[str, TensorStorageMetadata]) -> str:
    """Stream ``entries`` into the safetensors file ``out``: the header from the
    checkpoint's metadata, then one tensor at a time."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt", "source": "fullshard"}}
    offset = 0
    for entry in entries:
        m = tensors[entry.source]
        if m.properties.dtype not in _SAFETENSORS_DTYPES:
            raise CheckpointError(f"export: tensor '{entry.source}' has dtype "
                                  f"{m.properties.dtype}, which safetensors cannot store.")
        nbytes = _nbytes(m)
        shape = list(m.size)[::-1] if entry.transpose else list(m.size)
        header[entry.name] = {"dtype": _SAFETENSORS_DTYPES[m.properties.dtype],
                              "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the format aligns the data on 8 bytes
    prefix = _model_prefix(FileSystemReader(checkpoint.path).read_metadata().state_dict_metadata)
    tmp = f"{out}.partial"
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(blob)))
            f.write(blob)
            for entry in entries:
                tensor = _read_tensor(checkpoint, prefix, entry.source, tensors[entry.source])
                if entry.transpose:
                    tensor = tensor.t()
                f.write(tensor.contiguous().view(torch.uint8).numpy().tobytes())
        os.replace(tmp, out)
    except BaseException:
        # a failed export leaves no half-written file beside the one it meant to write
        if os.path.isfile(tmp):
            os.remove(tmp)
        raise
    return out


def _read_tensor(checkpoint: Checkpoint, prefix: str, name: str, m: TensorStorageMetadata
                 ) -> torch.Tensor:
    """One tensor, read on this process alone (DCP reads only its pieces)."""
    tensor = torch.empty(m.size, dtype=m.properties.dtype)
    _read_into(checkpoint, {prefix + name: tensor}, FileSystemReader(checkpoint.path),
               collective=False)
    return tensor
