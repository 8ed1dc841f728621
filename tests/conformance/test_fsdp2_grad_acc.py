"""Gradient accumulation's collectives, as torch's FSDP2 tests count them
(test_fully_shard_grad_acc.py, and the accumulation test of
test_fully_shard_training.py), in our own words.

Three micro-batches a step; reduction switched off for every unit but on the last
micro-batch, for the root's own parameters only (``recurse=False``), or for some
units; optionally units kept gathered across backward
(``set_reshard_after_backward(False)``) and, under HSDP, only the all-reduce across
replicas switched off (``set_requires_all_reduce``). Each step counts the
reduce-scatters, all-reduces and all-gathers, and the losses, gradients and weights
are those of a single-process copy fed every rank's rows. Counted with one collective
per unit (``set_bucket_numel(0)``): fullshard merges small units by default
(docs/conformance.md). 1-D at two ranks, HSDP (2 x 2) at four, one launch each.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from support.cast_reference import CastReference, assert_same_shards
from fullshard import CPUOffloadPolicy, OffloadPolicy, fully_shard
from fullshard.testing import run_distributed
from fullshard.testing.counting import count_collectives

DIM, MLPS, MICRO, SOME = 16, 3, 3, 2  # SOME: the MLPs that reduce on the last only
CLOSE = {"rtol": 1e-5, "atol": 1e-6}


class _MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.in_proj = nn.Linear(DIM, 2 * DIM)
        self.out_proj = nn.Linear(2 * DIM, DIM)

    def forward(self, x):
        return self.out_proj(torch.relu(self.in_proj(x)))


def _flags(model: nn.Sequential, mode: str, last: bool, keep_gathered: bool,
           all_reduce_only: bool) -> None:
    """Which units reduce this micro-batch (torch's test's three modes)."""
    targets, recurse = {"all": ([model], True), "root_only": ([model], False),
                        "some_mlps": (list(model[1:1 + SOME]), True)}[mode]
    for module in targets:
        if all_reduce_only:
            module.set_requires_all_reduce(last, recurse=recurse)
        else:
            module.set_requires_gradient_sync(last, recurse=recurse)
        if keep_gathered:
            module.set_reshard_after_backward(last, recurse=recurse)


def _expected(mode: str, reshard, keep_gathered: bool, hsdp: bool,
              all_reduce_only: bool) -> dict:
    """A step's counts: one reduction per unit on the last micro-batch, plus every
    micro-batch for units that keep reducing; one all-gather per unit in the first
    forward, plus every forward and backward for units resharded after forward (the
    root, given a reshard setting explicitly, is one of them)."""
    units = MLPS + 1
    reduce_scatters = units + {"all": 0, "some_mlps": units - SOME,
                               "root_only": MLPS}[mode] * (MICRO - 1)
    all_reduces = reduce_scatters if hsdp else 0
    if all_reduce_only:  # the reduce-scatter runs every micro-batch, the all-reduce not
        reduce_scatters = units * MICRO
    if reshard is not False:
        gathers = 2 * units * MICRO
    elif not keep_gathered:
        gathers = units * MICRO
    else:  # kept gathered across backward too: only what still reshards gathers again
        gathers = units + {"all": 0, "root_only": MLPS}[mode] * (MICRO - 1)
    return {"reduce_scatter": reduce_scatters, "all_reduce": all_reduces,
            "all_gather": gathers}


def _accumulate(mesh, mode: str, reshard, keep_gathered: bool, offload,
                all_reduce_only: bool = False) -> None:
    hsdp = mesh.ndim == 2
    what = (f"{'HSDP' if hsdp else '1-D'} {mode}, reshard {reshard}, kept gathered "
            f"{keep_gathered}, {offload}, all-reduce only {all_reduce_only}")
    torch.manual_seed(42)
    model = nn.Sequential(nn.Linear(DIM, DIM), *[_MLP() for _ in range(MLPS)])
    master = copy.deepcopy(model)
    for mlp in model[1:]:
        fully_shard(mlp, mesh=mesh, reshard_after_forward=reshard, offload_policy=offload)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard, offload_policy=offload)
    model.set_bucket_numel(0)  # one collective per unit, as torch
    optim = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=False)
    reference = CastReference(master, None, None)
    g = torch.Generator().manual_seed(dist.get_rank())
    for step in range(3):
        with count_collectives() as counts:
            for micro in range(MICRO):
                _flags(model, mode, micro == MICRO - 1, keep_gathered, all_reduce_only)
                x = torch.randn(2, DIM, generator=g)
                loss = model(x).sum()
                loss.backward()
                ref_loss = reference.forward_backward(lambda m: m(x).sum())
                torch.testing.assert_close(loss.detach(), ref_loss, **CLOSE)
        seen = {"all_gather": counts["all_gather"] + counts["all_gather_async"],
                "reduce_scatter": counts["reduce_scatter"], "all_reduce": counts["all_reduce"]}
        assert seen == _expected(mode, reshard, keep_gathered, hsdp, all_reduce_only), \
            (what, step, seen)
        reference.reduce()
        assert_same_shards(model, master, f"{what}, step {step}", **CLOSE)
        optim.step()
        optim.zero_grad(set_to_none=step % 2 == 1)  # zeroed: accumulate into kept grads
        reference.step(set_to_none=step % 2 == 1)


def _cases(mesh, offloads) -> None:
    for reshard in (True, False, 2):
        for mode in ("all", "root_only", "some_mlps"):
            for keep_gathered in ((False, True) if reshard is False and mode != "some_mlps"
                                  else (False,)):
                _accumulate(mesh, mode, reshard, keep_gathered, OffloadPolicy())
    for offload in offloads:
        for mode in ("all", "some_mlps"):
            _accumulate(mesh, mode, True, False, offload)


def _one_dimensional() -> None:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    _cases(mesh, [CPUOffloadPolicy(pin_memory=False)])


def _hybrid() -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    for mode in ("all", "root_only", "some_mlps"):
        _accumulate(mesh, mode, True, False, OffloadPolicy())
    _accumulate(mesh, "all", False, True, OffloadPolicy())
    _accumulate(mesh, "all", True, False, OffloadPolicy(), all_reduce_only=True)


@pytest.mark.extended  # make test has no time left: CI runs it in the extended lane
def test_accumulation_collectives_counted_as_torchs_fsdp2_tests_count_them():
    run_distributed(_one_dimensional, 2)


@pytest.mark.extended  # make test has no time left: CI runs it in the extended lane
def test_hybrid_accumulation_collectives_counted_as_torchs_fsdp2_tests_count_them():
    run_distributed(_hybrid, 4)
