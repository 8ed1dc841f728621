"""Failures in a run: a loss that stops being finite, workers killed mid-step and inside a
checkpoint save (``fullshard train`` subprocesses, faults injected by faults/sitecustomize.py)."""

import os
import re
import subprocess

import pytest
import torch

from fullshard import checkpoint
from fullshard.testing import run_distributed
from fullshard.train.config.schema import get_preset
from fullshard.train.model import build_model
from faults.sitecustomize import KILL_AT_STEP, KILL_IN_SAVE, POISON_AT_STEP, environment
from support.catalogue import matches_documented
from support.train_runs import checkpoints, fullshard_train_preset, metrics, train_in_process

STEPS, EVERY = 12, 4
FLAGS = {"steps": STEPS, "checkpoint.every": EVERY, "eval.every": 0, "eval.sample_tokens": 0}


def _fullshard_train(out: str, *flags: str, env: dict | None = None
                     ) -> subprocess.CompletedProcess:
    return fullshard_train_preset(out, "debug", FLAGS, *flags, env=env)


def _final_weights(out: str) -> dict[str, torch.Tensor]:
    model = build_model(get_preset("debug").gpt)  # a plain module: the full tensors
    checkpoint.load(os.path.join(out, "checkpoints", f"step_{STEPS:06d}"), model)
    return model.state_dict()


def _train_uninterrupted(out: str) -> None:
    train_in_process(out, "debug", FLAGS)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The step losses and final weights of the same run without faults (in-process: the
    trainer computes the same bits there as under torchrun)."""
    out = str(tmp_path_factory.mktemp("uninterrupted"))
    run_distributed(_train_uninterrupted, 2, out)
    return [r["loss"] for r in metrics(out) if "loss" in r], _final_weights(out)


def _assert_same_result(out: str, uninterrupted) -> None:
    losses, weights = uninterrupted
    records = metrics(out)
    assert [r["step"] for r in records] == list(range(STEPS + 1))
    assert [r["loss"] for r in records if "loss" in r] == losses
    got = _final_weights(out)
    assert got.keys() == weights.keys()
    for name, tensor in weights.items():
        assert torch.equal(got[name], tensor), name


@pytest.mark.extended
def test_worker_killed_inside_a_save_leaves_the_previous_checkpoint(tmp_path, uninterrupted):
    out = str(tmp_path / "run")
    # No restarts: look at the debris.
    killed = _fullshard_train(out, env=environment(KILL_IN_SAVE, 8))
    assert killed.returncode == 1, killed.stderr[-3000:]
    assert re.search(r"exitcode: -9\) local_rank: 0", killed.stderr)
    latest, entries = checkpoints(out)
    assert (latest, entries) == ("step_000004", [".step_000008.tmp", "step_000004"])
    partial = os.listdir(os.path.join(out, "checkpoints", ".step_000008.tmp"))
    assert any(name.endswith(".distcp") for name in partial)  # shards written, not committed
    assert "fullshard.json" not in partial

    resumed = _fullshard_train(out, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming at step 4," in resumed.stderr
    _assert_same_result(out, uninterrupted)
    assert checkpoints(out) == ("step_000012", ["step_000008", "step_000012"])


@pytest.mark.slow
@pytest.mark.extended
def test_a_training_that_stops_being_finite_ends_the_run_without_saving(tmp_path):
    """A weight turned NaN on one rank at step 4 makes that step's gradients non-finite on
    every rank: the run stops at that step, before its optimizer step could write
    non-finite weights or a checkpoint. (A learning rate large enough to diverge this
    quickly is refused by the flag's bounds.)"""
    out = str(tmp_path / "run")
    run = _fullshard_train(out, "--checkpoint.every", "1", "--max-restarts", "1",
                           env=environment(POISON_AT_STEP, 4))
    assert run.returncode == 3, run.stderr[-3000:]
    errors = [line for line in run.stderr.splitlines() if "stopped without saving" in line]
    # Rank 0 of the first attempt, then the restart, which repeats it instead of training.
    assert len(errors) == 2 and errors[0] == errors[1], run.stderr[-3000:]
    found = re.fullmatch(r"fullshard train: step (\d+): the (loss|gradient norm) is "
                         r"(nan|inf|-inf) \((mean over|over all) ranks\); stopped without "
                         r"saving \((step_\d+) is still the latest checkpoint\)\. .*", errors[0])
    assert found, errors[0]
    assert matches_documented("E34", "Diverged: " + errors[0].removeprefix("fullshard train: "))
    step, latest = int(found[1]), found[5]
    assert "resuming" not in run.stderr
    good = step - 1  # checkpoints every step: the last finite step is the latest one
    assert step == 4 and latest == f"step_{good:06d}"
    assert checkpoints(out) == (latest, [f"step_{s:06d}" for s in range(1, good + 1)][-2:])
    assert [r["step"] for r in metrics(out)] == list(range(step))  # nothing of the bad step


@pytest.mark.slow
def test_workers_killed_mid_step_and_in_a_save_restart_and_leave_nothing_on_disk(
        tmp_path, uninterrupted):
    """Rank 0 killed inside the save of step 8, then, on the restart, rank 1 as step 10
    starts (step 9's optimizer states on disk, the read of step 10's first chunk queued):
    each restart resumes from the job's last committed checkpoint, the run ends with the
    uninterrupted run's losses and weights, and nothing is left under the offload path
    (states and parameters are kept in files without names)."""
    out, offload = str(tmp_path / "run"), tmp_path / "offload"
    offload.mkdir()
    env = {**environment(KILL_IN_SAVE, 8), **environment(KILL_AT_STEP, "100,10")}
    run = _fullshard_train(out, "--max-restarts", "2", f"--parallel.offload=disk:{offload}",
                           "--parallel.offload_params=true", env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    assert re.search(r"exitcode: -9\) local_rank: 0", run.stderr)  # torchrun saw the kills
    assert re.search(r"exitcode: -9\) local_rank: 1", run.stderr)
    assert re.findall(r"resuming at step (\d+),", run.stderr) == ["4", "8"], run.stderr[-3000:]
    assert "memory: estimated peak" in run.stderr
    _assert_same_result(out, uninterrupted)
    assert checkpoints(out) == ("step_000012", ["step_000008", "step_000012"])
    assert os.listdir(offload) == []
