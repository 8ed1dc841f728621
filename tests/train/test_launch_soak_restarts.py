"""A long run that loses a worker every ~300 steps still ends exactly where an
uninterrupted run ends (``make soak``; 48 minutes on 2 cores, so not in ``make test``).

2,000 steps of the default preset, a checkpoint every 50, and a worker chosen at random
killed (SIGKILL) at a random step every 250-350 steps under ``--max-restarts``: torchrun
restarts both workers each time, they resume from the latest checkpoint, and the run's
per-step losses and final weights must equal those of the same run without faults, bit
for bit. Kills come from faults/sitecustomize.py, the i-th on the job's i-th attempt.
"""

from __future__ import annotations

import random
import re

import pytest
import torch

from faults.sitecustomize import KILL_AT_STEP, KILL_RANK, environment
from fullshard import checkpoint
from fullshard.testing import run_distributed
from fullshard.train.config.schema import DEFAULT_PRESET, get_preset
from fullshard.train.model import build_model
from support.train_runs import checkpoints, fullshard_train_preset, metrics, train_in_process

pytestmark = pytest.mark.soak

STEPS, EVERY = 2000, 50
FLAGS = {"steps": STEPS, "checkpoint.every": EVERY, "eval.every": 0, "eval.sample_tokens": 0}


def _kills(seed: int = 0) -> tuple[list[int], list[int]]:
    """Steps (one every 250-350) and the rank killed at each."""
    rng = random.Random(seed)
    steps, step = [], 0
    while True:
        step += rng.randint(250, 350)
        if step >= STEPS:
            return steps, [rng.randint(0, 1) for _ in steps]
        steps.append(step)


def _weights(out: str) -> dict[str, torch.Tensor]:
    model = build_model(get_preset(DEFAULT_PRESET).gpt)
    checkpoint.load(f"{out}/checkpoints/step_{STEPS:06d}", model)
    return model.state_dict()


def test_a_worker_killed_every_300_steps_ends_with_the_uninterrupted_weights(tmp_path):
    reference = str(tmp_path / "uninterrupted")
    run_distributed(train_in_process, 2, reference, DEFAULT_PRESET, FLAGS, timeout=3600)
    steps, ranks = _kills()
    out = str(tmp_path / "soak")
    fault = {**environment(KILL_AT_STEP, ",".join(map(str, steps))),
             KILL_RANK: ",".join(map(str, ranks))}
    run = fullshard_train_preset(out, DEFAULT_PRESET, FLAGS, "--max-restarts",
                                  str(len(steps)), env=fault, timeout=3600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert len(re.findall(r"exitcode: -9\) local_rank: \d", run.stderr)) == len(steps)
    resumed = [int(s) for s in re.findall(r"resuming at step (\d+),", run.stderr)]
    assert resumed == [(s - 1) // EVERY * EVERY for s in steps], (resumed, steps)
    records = [r for r in metrics(out) if "loss" in r]
    expected = [r for r in metrics(reference) if "loss" in r]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in records] == [r["loss"] for r in expected]
    got, want = _weights(out), _weights(reference)
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name
    assert checkpoints(out)[0] == f"step_{STEPS:06d}"
