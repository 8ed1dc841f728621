"""A run's checkpoints: ``OUT/checkpoints/step_NNNNNN`` through ``fullshard.checkpoint``
(atomic, verified, reshardable), ``OUT/checkpoints/latest`` naming the newest.

Besides the model and the optimizer, a checkpoint's ``extra`` holds what else decides
the steps after it: the step, the data position (Note [epochs of disjoint windows]),
every rank's RNG state (dropout in Hugging Face models), the fp16 loss scaler, and the
torchrun job that saved it (Note [restarts] in elastic.py).
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import checkpoint
from .config import ConfigError
from .launch import job_id

STEP_DIR = re.compile(r"^step_(\d+)$")


@dataclass
class ResumePoint:
    step: int
    data_position: dict
    scaler: dict | None


def checkpoint_dir(out: str) -> str:
    return os.path.join(out, "checkpoints")


def _rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def save(out: str, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
         data_position: dict, scaler: Any, device: torch.device, keep: int) -> str:
    """Save step ``step`` on every rank (collective); rank 0 then deletes all but the
    ``keep`` newest."""
    rng_states: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(rng_states, _rng_state(device))
    extra = {"step": step, "data": data_position, "rng": rng_states,
             "scaler": scaler.state_dict() if scaler is not None else None, "job": job_id()}
    path = checkpoint.save(os.path.join(checkpoint_dir(out), f"step_{step:06d}"), model,
                           optimizer, extra=extra)
    if dist.get_rank() == 0:
        _prune(checkpoint_dir(out), keep)
    return path


def _prune(directory: str, keep: int) -> None:
    steps = sorted(name for name in os.listdir(directory) if STEP_DIR.match(name))
    for name in steps[:-keep]:
        shutil.rmtree(os.path.join(directory, name), ignore_errors=True)


def has_checkpoint(out: str) -> bool:
    return os.path.isfile(os.path.join(checkpoint_dir(out), checkpoint.io.LATEST))


def latest_name(out: str) -> str | None:
    """The name ``latest`` holds (e.g. ``step_000040``), or None before the first save."""
    if not has_checkpoint(out):
        return None
    with open(os.path.join(checkpoint_dir(out), checkpoint.io.LATEST)) as f:
        return f.read().strip()


def saved_job(out: str) -> str | None:
    """The torchrun job id the latest checkpoint in ``out`` was saved by (None: unknown)."""
    latest = checkpoint.io.resolve(checkpoint_dir(out))
    extra = torch.load(os.path.join(latest, checkpoint.io.EXTRA), weights_only=False)
    return extra.get("job")


def load(out: str, model: nn.Module, optimizer: torch.optim.Optimizer,
         device: torch.device) -> ResumePoint:
    """Load the latest checkpoint of the run in ``out`` into ``model`` and ``optimizer``;
    restore this rank's RNG state when the world size is the one it was saved at."""
    if not has_checkpoint(out):
        raise ConfigError(f"--resume: no checkpoint in {checkpoint_dir(out)}; run without "
                          "--resume to start there")
    extra = checkpoint.load(checkpoint_dir(out), model, optimizer)
    rng_states = extra["rng"]
    if len(rng_states) == dist.get_world_size():
        state = rng_states[dist.get_rank()]
        torch.set_rng_state(state["cpu"])
        if "cuda" in state and device.type == "cuda":
            torch.cuda.set_rng_state(state["cuda"], device)
    return ResumePoint(extra["step"], extra["data"], extra["scaler"])


def clear(out: str) -> None:
    """Delete the checkpoints of an earlier run in ``out`` (rank 0, fresh starts)."""
    shutil.rmtree(checkpoint_dir(out), ignore_errors=True)
