"""Checkpoint directories of every kind the readers must tell apart, and damage done to
their files (tests of fullshard.checkpoint's verification and its fault suite)."""

from __future__ import annotations

import os
import warnings

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn

from fullshard import checkpoint


def small_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 3))


def fullshard_checkpoint(parent: str, model: nn.Module | None = None) -> str:
    return checkpoint.save(os.path.join(parent, "step_1"), model or small_model(),
                           extra={"step": 1})


def torch_checkpoint(path: str, model: nn.Module | None = None) -> str:
    """``model.state_dict()`` saved by torch's DCP alone, in one process."""
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"model": (model or small_model()).state_dict()}, checkpoint_id=path,
                 no_dist=True)
    return path


def shard_file(path: str) -> str:
    return os.path.join(path, sorted(n for n in os.listdir(path) if n.endswith(".distcp"))[0])


def flip_byte(file: str, at: float = 0.5, mask: int = 0xFF) -> None:
    data = bytearray(open(file, "rb").read())
    data[min(int(at * len(data)), len(data) - 1)] ^= mask
    with open(file, "wb") as f:
        f.write(bytes(data))


def truncate(file: str, at: float = 0.5) -> None:
    with open(file, "r+b") as f:
        f.truncate(int(at * os.path.getsize(file)))
