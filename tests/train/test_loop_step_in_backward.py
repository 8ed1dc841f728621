"""--parallel.step_in_backward: the offloaded blocks stepped as the last micro-batch's
backward hands out their gradients (Note [the trainer's step in backward]): the default
trainer's losses and gradient norms, and a resume that trains on exactly."""

import os

import pytest
import torch
import torch.distributed as dist

from fullshard.testing import run_distributed
from fullshard.train.config.flags import apply_overrides
from fullshard.train.config.schema import ConfigError, get_preset, validate
from fullshard.train.launch.launcher import Worker
from fullshard.train.loop import Trainer
from support.train_runs import QUIET, assert_resumed_exactly, straight_and_resumed

RUNS = {"cpu": {"parallel.offload": "cpu"},
        "half, two micro-batches": {"parallel.offload": "cpu:0.5", "batch.grad_accum": 2},
        "states on disk": {"parallel.offload": "disk:{out}"},  # a folder made per run
        "half on disk": {"parallel.offload": "disk:{out}:0.5"}}


def _both_ways(out: str) -> dict:
    """Each of RUNS with and without step_in_backward: rank 0's losses and gradient
    norms, and how many blocks every rank's host thread took during backward."""
    from fullshard.overlapped_step import OverlappedStep

    handed = []
    on_reduced = OverlappedStep._on_reduced

    def counting(self, params, all_present):
        before = len(self._from_backward)
        on_reduced(self, params, all_present)
        handed.append(len(self._from_backward) - before)

    OverlappedStep._on_reduced = counting
    rank, world = dist.get_rank(), dist.get_world_size()
    worker = Worker(rank, world, rank, world, torch.device("cpu"))
    results = {}
    try:
        for name, fields in RUNS.items():
            for on in (False, True):
                handed.clear()
                states = f"{out}/{name}-{on}-states-{rank}"
                os.makedirs(states)
                placed = {k: v.replace("{out}", states) if isinstance(v, str) else v
                          for k, v in fields.items()}
                cfg = apply_overrides(get_preset("debug"), {
                    **QUIET, **placed, "steps": 4, "batch.batch_size": 2,
                    "optim.grad_clip": 0.0, "parallel.step_in_backward": on}, "test")
                trainer = Trainer(cfg, f"{out}/{name}-{on}", worker)
                trainer.run(resume=False)
                records = trainer.log.records if trainer.log is not None else []
                results[name, on] = ([r["loss"] for r in records if "loss" in r],
                                     [r["grad_norm"] for r in records if "loss" in r],
                                     sum(handed))
    finally:
        OverlappedStep._on_reduced = on_reduced
    return results


@pytest.mark.slow
def test_stepping_in_backward_trains_as_the_default_trainer(tmp_path):
    ranks = run_distributed(_both_ways, 2, str(tmp_path))
    results = ranks[0]
    for name in RUNS:
        (losses, norms, _), (stepped, stepped_norms, handed) = results[name, False], \
            results[name, True]
        assert len(losses) == 4 and losses[-1] < losses[0], name
        assert stepped == losses and stepped_norms == norms, (name, stepped, losses)
        for rank in ranks:  # the blocks went to the host thread during backward
            assert rank[name, False][2] == 0 and rank[name, True][2] > 0, (name, rank)


def _resume(out: str, offload: str) -> dict[str, list[float]] | None:
    if offload == "disk":
        offload = f"disk:{out}/states-{dist.get_rank()}"
        os.makedirs(offload[len("disk:"):])
    return straight_and_resumed(out, {"parallel.offload": offload,
                                      "parallel.step_in_backward": True,
                                      "optim.grad_clip": 0.0, "batch.batch_size": 2})[0]


@pytest.mark.slow
@pytest.mark.parametrize("offload", ["cpu", "disk"])
def test_a_run_stepping_in_backward_resumes_exactly(tmp_path, offload):
    runs = run_distributed(_resume, 2, str(tmp_path), offload)[0]
    assert_resumed_exactly(runs)


@pytest.mark.parametrize("fields, says", [
    ({"parallel.offload": "none"}, "parallel.offload none offloads none"),
    ({"parallel.offload": "cpu", "optim.grad_clip": 1.0}, "the gradient clip"),
    ({"parallel.offload": "cpu", "optim.grad_clip": 0.0, "parallel.precision": "fp16"},
     "the fp16 loss scale"),
    ({"parallel.offload": "cpu", "optim.grad_clip": 0.0, "parallel.delayed_update": 0},
     "parallel.delayed_update -1"),
    ({"parallel.offload": "cpu", "optim.grad_clip": 0.0, "parallel.overlap_step": False},
     "parallel.overlap_step true"),
], ids=["no offload", "clip", "fp16", "delayed", "no overlap"])
def test_where_stepping_in_backward_cannot_work_is_refused_in_one_line(fields, says):
    cfg = apply_overrides(get_preset("debug"), {**fields, "parallel.step_in_backward": True},
                          "test")
    with pytest.raises(ConfigError, match="parallel.step_in_backward: ") as error:
        validate(cfg)
    assert says in str(error.value) and "\n" not in str(error.value)
