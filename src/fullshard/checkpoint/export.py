"""Inspect a checkpoint, and export its model to one ``.safetensors`` file.

Both run in one process with no process group. Export streams: it writes the
safetensors header from the checkpoint's metadata first, then reads and appends
one tensor at a time (DCP reads only the pieces of that tensor from the shard
files), so its peak memory is about the largest tensor, not the model.
"""

from __future__ import annotations

import json
import os
import struct
import warnings
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from .io import EXTRA, CheckpointError, _verify_files, read_manifest, resolve

MODEL_PREFIX = "model."
_SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}


def model_tensors(path: str) -> dict[str, TensorStorageMetadata]:
    """Model tensor name (without the ``model.`` prefix) -> its DCP metadata."""
    meta = FileSystemReader(path).read_metadata().state_dict_metadata
    return {k[len(MODEL_PREFIX):]: v for k, v in meta.items()
            if k.startswith(MODEL_PREFIX) and isinstance(v, TensorStorageMetadata)}


def inspect(path: str | os.PathLike, verify: bool = True) -> dict[str, Any]:
    """What a checkpoint holds: world size, extra, and each model tensor's shape,
    dtype and bytes; with ``verify`` also whether every file matches its checksum."""
    path = resolve(path)
    manifest = read_manifest(path)
    status = "not checked"
    if verify:
        try:
            _verify_files(path, manifest["files"])
            status = "ok"
        except CheckpointError as err:
            status = str(err)
    extra = torch.load(os.path.join(path, EXTRA), weights_only=False)
    tensors = {name: {"shape": list(m.size), "dtype": str(m.properties.dtype).removeprefix(
        "torch."), "bytes": m.size.numel() * m.properties.dtype.itemsize}
        for name, m in model_tensors(path).items()}
    return {"path": path, "world_size": manifest["world_size"],
            "has_optimizer": manifest.get("has_optimizer", False), "checksums": status,
            "extra": extra, "tensors": tensors,
            "bytes": sum(f["bytes"] for f in manifest["files"].values())}


def export_safetensors(path: str | os.PathLike, out: str | os.PathLike) -> str:
    """Write the checkpoint's model tensors, unsharded, to one ``.safetensors`` file."""
    path = resolve(path)
    read_manifest(path)
    tensors = model_tensors(path)
    header: dict[str, Any] = {"__metadata__": {"format": "pt", "source": "fullshard"}}
    offset = 0
    for name, m in tensors.items():
        if m.properties.dtype not in _SAFETENSORS_DTYPES:
            raise CheckpointError(f"export: tensor '{name}' has dtype {m.properties.dtype}, "
                                  "which safetensors cannot store.")
        nbytes = m.size.numel() * m.properties.dtype.itemsize
        header[name] = {"dtype": _SAFETENSORS_DTYPES[m.properties.dtype],
                        "shape": list(m.size), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the format aligns the data on 8 bytes
    out = os.fspath(out)
    tmp = f"{out}.partial"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name, m in tensors.items():
            f.write(_read_tensor(path, name, m).contiguous().view(torch.uint8).numpy().tobytes())
    os.replace(tmp, out)
    return out


def _read_tensor(path: str, name: str, m: TensorStorageMetadata) -> torch.Tensor:
    target = {MODEL_PREFIX + name: torch.empty(m.size, dtype=m.properties.dtype)}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(target, storage_reader=FileSystemReader(path), no_dist=True)
    return target[MODEL_PREFIX + name]
