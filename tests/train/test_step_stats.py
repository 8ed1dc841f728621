"""The statistics that close a trainer step (train/step_stats.py): on real gloo ranks the
same numbers as gathering every rank's and reducing them on the host, and in a run's
metrics.jsonl every rank's peak only on the steps that gather it."""

import random

import pytest
import torch
import torch.distributed as dist

from fullshard.testing import run_distributed
from fullshard.train.step_stats import reduce_stats
from support.train_runs import metrics, train_in_process

TRIALS = 50


def _losses(world: int, spread: bool) -> list[list[float]]:
    """Per trial, each rank's loss: float32 values, as a step's loss is, in float64. Of
    like magnitude (as ranks' losses are) they add exactly in any order; ``spread``: one
    rank's (a different one each trial) is ~2^38 times the others', so that float64 sums
    of them round and the order of the additions shows."""
    rng = random.Random(world)
    small = 2.0**-35 if spread else 1.0
    return [[float(torch.tensor(rng.uniform(1, 2) * (8.0 if rank == trial % world else small)))
             for rank in range(world)] for trial in range(TRIALS)]


def _reduced(peaks: bool, spread: bool) -> list[tuple]:
    rank, world = dist.get_rank(), dist.get_world_size()
    out = []
    for trial, losses in enumerate(_losses(world, spread)):
        # [loss, grad_norm, stop request, peak, one phase's peak]; rank 1 asks to stop
        mine = torch.tensor([losses[rank], 0.25 * trial, float(rank == 1),
                             1000.0 * (rank + 1) + trial, 7.0 - rank], dtype=torch.float64)
        stats = reduce_stats(mine, world, peaks)
        out.append((stats.loss, stats.grad_norm, stats.stopping, stats.figures.tolist(),
                    stats.peaks))
    return out


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("peaks", [False, True])
def test_the_statistics_are_the_host_reduction_of_every_ranks(world, peaks):
    """The loss is bit for bit the mean the trainer took over the gathered losses
    (float64 on the host: their sum over the ranks, divided by the world)."""
    got = run_distributed(_reduced, world, peaks, False)
    assert all(ranks == got[0] for ranks in got)  # every rank decides alike
    for trial, (losses, stats) in enumerate(zip(_losses(world, False), got[0])):
        loss, grad_norm, stopping, figures, per_rank = stats
        assert loss == float(torch.tensor(losses, dtype=torch.float64).mean()), trial
        assert (grad_norm, stopping) == (0.25 * trial, True)
        assert figures == [1000.0 * world + trial, 7.0]  # each at its largest
        want = [1000 * (r + 1) + trial for r in range(world)]
        assert per_rank == (want if peaks else None)


@pytest.mark.parametrize("world", [2, 3])
def test_losses_far_apart_differ_from_the_host_mean_by_the_order_of_additions(world):
    """Where float64 sums of the losses round, the backend's order of additions is not
    the host's: the mean may differ in its last bit (never at 2 ranks: a + b = b + a)."""
    got = run_distributed(_reduced, world, False, True)
    assert all(ranks == got[0] for ranks in got)
    for losses, stats in zip(_losses(world, True), got[0]):
        want = float(torch.tensor(losses, dtype=torch.float64).mean())
        assert stats[0] == (want if world == 2 else pytest.approx(want, rel=1e-15, abs=0))


@pytest.mark.slow
def test_every_ranks_peak_is_listed_on_the_first_evaluated_saved_and_last_steps(tmp_path):
    out = str(tmp_path)
    run_distributed(train_in_process, 2, out, "debug",
                    {"steps": 7, "eval.every": 3, "checkpoint.every": 5,
                     "eval.sample_tokens": 0})
    steps = [r for r in metrics(out) if "loss" in r]
    listed = [r["step"] for r in steps if "peak_mem_bytes_per_rank" in r]
    assert listed == [1, 3, 5, 6, 7]
    for record in steps:
        per_rank = record.get("peak_mem_bytes_per_rank")
        assert per_rank is None or (len(per_rank) == 2
                                    and max(per_rank) == record["peak_mem_bytes"])
