"""Runs of ``fullshard train`` as the trainer tests start them (a subprocess, or the
trainer in each rank's process) and what the tests read back from their folders."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import torch
import torch.distributed as dist

from fullshard.train.config.schema import get_preset
from fullshard.train.config.flags import apply_overrides
from fullshard.train.launch.launcher import Worker
from fullshard.train.loop import Trainer

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
TIMEOUT_S = 240
# a short run with nothing but training steps
QUIET = {"steps": 4, "eval.every": 0, "eval.sample_tokens": 0, "checkpoint.every": 0}


def fullshard_train_preset(out: str, preset: str, fields: dict, *flags: str,
                           env: dict | None = None, timeout: float = TIMEOUT_S
                           ) -> subprocess.CompletedProcess:
    """``fullshard train --preset PRESET --FIELD=VALUE ... --out OUT FLAGS``."""
    options = [f"--{k}={v}" for k, v in fields.items()]
    return subprocess.run(
        [sys.executable, "-m", "fullshard", "train", "--preset", preset, *options,
         "--out", out, *flags], env={**ENV, **(env or {})}, capture_output=True, text=True,
        timeout=timeout)


def train_in_process(out: str, preset: str, fields: dict) -> None:
    """The trainer's run in this rank's process (under run_distributed)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = apply_overrides(get_preset(preset), fields, "test")
    Trainer(cfg, out, Worker(rank, world, rank, world, torch.device("cpu"))).run(resume=False)


def metrics(out: str) -> list[dict]:
    """The run's metrics.jsonl records."""
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def checkpoints(out: str) -> tuple[str, list[str]]:
    """``latest``, and every entry of the checkpoint directory but ``latest``."""
    directory = os.path.join(out, "checkpoints")
    with open(os.path.join(directory, "latest")) as f:
        return f.read().strip(), sorted(set(os.listdir(directory)) - {"latest"})


def train_losses(overrides: dict, preset: str = "debug", keep: list | None = None
                 ) -> list[float] | None:
    """Train ``preset`` with ``overrides``; rank 0 returns the step losses. The trainer
    is appended to ``keep`` when given (every rank), for what a test asks of it."""
    cfg = apply_overrides(get_preset(preset), {**QUIET, **overrides}, "test")
    rank, world = dist.get_rank(), dist.get_world_size()
    worker = Worker(rank, world, rank, world, torch.device("cpu"))
    with tempfile.TemporaryDirectory() as out:
        out = [out]
        dist.broadcast_object_list(out)  # rank 0's directory for everyone
        trainer = Trainer(cfg, out[0], worker)
        trainer.run(resume=False)
    if keep is not None:
        keep.append(trainer)
    if trainer.log is None:
        return None
    return [r["loss"] for r in trainer.log.records if "loss" in r]


def straight_and_resumed(out: str, overrides: dict, read=lambda record: record["loss"],
                         preset: str = "debug") -> tuple[dict[str, list] | None, Trainer]:
    """``preset`` with ``overrides`` trained 6 steps straight (in ``out/straight``), and 3
    steps then a resume to 6 (in ``out/resumed``), a checkpoint every 3. Rank 0 gets each
    run's step records read through ``read`` (other ranks None), and every rank the last
    trainer, for what a test asks of it."""
    rank, world = dist.get_rank(), dist.get_world_size()
    worker = Worker(rank, world, rank, world, torch.device("cpu"))
    runs = {}
    for name, legs in {"straight": [(6, False)], "resumed": [(3, False), (6, True)]}.items():
        for steps, resume in legs:
            cfg = apply_overrides(get_preset(preset), {**QUIET, **overrides, "steps": steps,
                                                       "checkpoint.every": 3}, "test")
            trainer = Trainer(cfg, os.path.join(out, name), worker)
            trainer.run(resume=resume)
        if trainer.log is not None:
            runs[name] = [read(r) for r in trainer.log.records if "loss" in r]
    return (runs if trainer.log is not None else None), trainer


def assert_resumed_exactly(runs: dict[str, list]) -> None:
    """What ``straight_and_resumed`` gave rank 0, judged: the straight run trained its 6
    steps with a falling loss, and the resumed run's steps after the checkpoint are the
    straight run's, bit for bit."""
    straight, resumed = runs["straight"], runs["resumed"]
    assert len(straight) == 6 and straight[-1] < straight[0], straight
    assert resumed[-3:] == straight[-3:], (straight, resumed)


def tensorboard_scalars(out: str) -> dict[str, list[tuple[int, float]]]:
    """Each scalar tag of the event files in ``out``: its (step, value) pairs."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(out)
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)]
            for tag in events.Tags()["scalars"]}
