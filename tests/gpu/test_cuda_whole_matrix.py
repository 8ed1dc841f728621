"""CUDA lane: torch.optim.Muon on fully_shard's matrices over NCCL steps them as one
process given the same gradients does, with the optimizer's state on the GPU
(Note [whole-matrix optimizers])."""

import lanes

lanes.require_cuda_lane()

import pytest  # noqa: E402 - only once the lane is known to run
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from fullshard.testing import (collectives_at_one_rank, rank_device,  # noqa: E402
                               run_distributed, visible_gpus)
from fullshard.testing.parity import full_value  # noqa: E402
from support.whole_matrix_runs import mlp_blocks, shard_blocks  # noqa: E402

pytestmark = pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon")

WORLD = visible_gpus()


def _optimizers(model):
    matrices = [p for p in model.parameters() if p.ndim == 2]
    others = [p for p in model.parameters() if p.ndim != 2]
    return [torch.optim.Muon(matrices, lr=0.02, weight_decay=0.1),
            torch.optim.AdamW(others, lr=1e-3)]


def _muon_step_parity():
    collectives_at_one_rank()  # one GPU: the gathers and reductions run, not shortcuts
    rank, dev = dist.get_rank(), rank_device()
    model = shard_blocks(mlp_blocks().to(dev))
    reference = mlp_blocks().to(dev)
    opts = _optimizers(model) + _optimizers(reference)
    for step in range(4):
        gen = torch.Generator().manual_seed(step)
        xs = [torch.randn(4, 24, generator=gen).to(dev) for _ in range(WORLD)]
        model(xs[rank]).square().mean().backward()
        for p, q in zip(model.parameters(), reference.parameters()):
            q.grad = full_value(p.grad).clone()
        for opt in opts:
            opt.step()
            opt.zero_grad()
    # the owners keep Muon's momentum between steps; state_dict() hands it back sharded
    devices = {getattr(t, "device", torch.device("meta")).type
               for state in opts[0].state_dict()["state"].values()
               for t in state.values() if isinstance(t, torch.Tensor)}
    diff = max((full_value(p.detach()) - q.detach()).abs().max().item()
               for p, q in zip(model.parameters(), reference.parameters()))
    return devices, diff


def test_muon_on_sharded_gpu_matrices_steps_as_one_process():
    for devices, diff in run_distributed(_muon_step_parity, WORLD, backend="nccl"):
        assert devices == {"cuda"}, devices
        assert diff == 0.0, diff
