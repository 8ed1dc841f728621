"""Optimizers that need whole matrices step sharded parameters as one process does
(Note [whole-matrix optimizers]): torch.optim.Muon on the matrices, AdamW on the rest."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from fullshard import CPUOffloadPolicy, DiskOffloadPolicy, MixedPrecisionPolicy, fully_shard
from fullshard.testing import run_distributed
from fullshard.testing.parity import full_value
from support.catalogue import matches_documented
from support.whole_matrix_runs import max_diff, mlp_blocks, shard_blocks, train_steps

pytestmark = pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon")

STEPS = 4


def _optimizers(model: nn.Module) -> list[torch.optim.Optimizer]:
    matrices = [p for p in model.parameters() if p.ndim == 2]
    others = [p for p in model.parameters() if p.ndim != 2]
    return [torch.optim.Muon(matrices, lr=0.02, weight_decay=0.1),
            torch.optim.AdamW(others, lr=1e-3)]


def _parity(**kwargs) -> dict:
    """Two references: one process given the sharded run's reduced gradients, stepped by
    the stock optimizers (the step itself: exactly equal), and one process training on
    every rank's batch (end to end: equal up to how the gradients were summed, which
    Muon's bf16 Newton-Schulz turns into ~1e-3 relative differences)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    micro = kwargs.pop("micro_batches", 1)
    model = shard_blocks(mlp_blocks(), **kwargs)
    same_grads, one_process = mlp_blocks(), mlp_blocks()
    opts = [_optimizers(m) for m in (model, same_grads, one_process)]
    for step in range(STEPS):
        train_steps(model, [], 1, rank, world, first=step, micro_batches=micro)
        train_steps(one_process, [], 1, rank, world, first=step, micro_batches=micro,
               sharded=False)
        for p, q in zip(model.parameters(), same_grads.parameters()):
            q.grad = full_value(p.grad) if p.grad is not None else None
        for opt in [o for group in opts for o in group]:
            opt.step()
            opt.zero_grad()
    return {"step": max_diff(model, same_grads), "end to end": _relative(model, one_process)}


def _relative(model, reference) -> float:
    return max(((full_value(p.detach()) - q.detach()).norm() / q.detach().norm()).item()
               for p, q in zip(model.parameters(), reference.parameters()))


def _on_dim_1(p: torch.Tensor):
    """Shard(1) where the columns split evenly at every world size tried (24 of them):
    the blocks' first weights (37 x 24); their second (24 x 37) stay on dim 0."""
    from torch.distributed.tensor import Shard
    return Shard(1) if p.ndim == 2 and p.shape[1] % 12 == 0 else None


def _cases() -> dict:
    out = {"plain": _parity(), "accumulation": _parity(micro_batches=2),
           "shard on dim 1": _parity(shard_placement_fn=_on_dim_1),
           "cpu offload": _parity(offload_policy=CPUOffloadPolicy()),
           "bf16": _parity(mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                          reduce_dtype=torch.float32))}
    if dist.get_world_size() == 4:
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        out["hybrid"] = _parity(mesh=mesh)
    return out


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.slow
def test_muon_steps_sharded_matrices_as_one_process(world):
    for name, diff in run_distributed(_cases, world)[0].items():
        assert diff["step"] == 0.0, (name, diff)
        if name == "bf16":
            continue  # one process computes in fp32: the step alone is compared
        # gradients summed in another order, through Muon's bf16 Newton-Schulz: up to
        # ~3e-3 here; shard-local steps (torch's FSDP2) end 1e-2 to 2.3e-2 away
        assert diff["end to end"] < 5e-3, (name, diff)


def _resume(directory: str, **how) -> float:
    """Save at step 2 (Muon's momentum buffers sharded in the checkpoint), load into a
    fresh model and optimizers, train on: the same as training straight through."""
    from fullshard import checkpoint
    rank, world = dist.get_rank(), dist.get_world_size()
    straight = shard_blocks(mlp_blocks(), **how)
    straight_opts = _optimizers(straight)
    train_steps(straight, straight_opts, 4, rank, world)
    model = shard_blocks(mlp_blocks(), **how)
    opts = _optimizers(model)
    train_steps(model, opts, 2, rank, world)
    checkpoint.save(directory, model, opts[0])
    # the owners' momentum handed back in torch's layout: a DTensor sharded like its
    # parameter (on dim 1 too)
    for p, s in opts[0].state.items():
        buffer = s["momentum_buffer"]
        assert isinstance(buffer, torch.distributed.tensor.DTensor)
        assert buffer.placements == p.placements
        assert buffer.to_local().shape == p.to_local().shape
    resumed = shard_blocks(mlp_blocks(), **how)
    resumed_opts = _optimizers(resumed)
    checkpoint.load(directory, resumed, resumed_opts[0])
    resumed_opts[1].load_state_dict(opts[1].state_dict())
    train_steps(resumed, resumed_opts, 2, rank, world, first=2)
    diff = max((full_value(a.detach()) - full_value(b.detach())).abs().max().item()
               for a, b in zip(resumed.parameters(), straight.parameters()))
    return diff, {p.placements[-1].dim for p in opts[0].state}


@pytest.mark.parametrize("how", ["rows", "columns"])
@pytest.mark.slow
def test_a_muon_checkpoint_resumes_exactly(tmp_path, how):
    sharding = {"shard_placement_fn": _on_dim_1} if how == "columns" else {}
    for diff, placements in run_distributed(_resume, 2, str(tmp_path / "ckpt"), **sharding):
        assert diff == 0.0, diff
        assert placements == ({0, 1} if sharding else {0}), placements


class _NormalizedSGD(torch.optim.Optimizer):
    """An optimizer whose update needs the whole matrix: the gradient scaled to unit
    Frobenius norm (on a shard, each shard would be scaled by its own norm)."""

    def __init__(self, params, lr):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    state = self.state[p]
                    state["steps"] = state.get("steps", 0) + 1
                    p.add_(p.grad / p.grad.norm(), alpha=-group["lr"])


def _registered() -> float:
    from fullshard import register_whole_matrix_optimizer
    register_whole_matrix_optimizer(_NormalizedSGD)
    rank, world = dist.get_rank(), dist.get_world_size()
    reference, model = mlp_blocks(), shard_blocks(mlp_blocks())
    opts = [_NormalizedSGD(model.parameters(), 0.01)]
    train_steps(model, opts, STEPS, rank, world)
    train_steps(reference, [_NormalizedSGD(reference.parameters(), 0.01)], STEPS, rank, world,
           sharded=False)
    # kept by the owners between steps, on every rank in the state dict
    steps = [s["steps"] for s in opts[0].state_dict()["state"].values()]
    assert steps == [STEPS] * len(list(model.parameters())), steps
    return max_diff(model, reference)


@pytest.mark.slow
def test_a_registered_whole_matrix_optimizer_steps_as_one_process():
    for diff in run_distributed(_registered, 3):
        assert diff < 1e-6, diff


def _misuse(directory: str) -> dict:
    out = {}
    for name, kwargs in {"states on disk": {"offload_policy": DiskOffloadPolicy(path=directory)}
                         }.items():
        model = mlp_blocks()
        for block in model:
            fully_shard(block, **kwargs)
        fully_shard(model)
        model(torch.randn(2, 24)).sum().backward()
        try:
            _optimizers(model)[0].step()
            out[name] = "no error"
        except RuntimeError as err:
            out[name] = str(err)
    return out


@pytest.mark.slow
def test_what_cannot_be_stepped_whole_is_refused_at_the_first_step(tmp_path):
    for out in run_distributed(_misuse, 2, str(tmp_path)):
        assert "Muon needs whole matrices" in out["states on disk"], out
        assert "'0.0.weight'" in out["states on disk"], out
        assert "optimizer states on disk" in out["states on disk"], out
        for text in out.values():
            assert matches_documented("E151", f"RuntimeError: {text}"), text


def _adafactor() -> float:
    """torch.optim.Adafactor factors each matrix's second moment over whole rows and
    columns: stepped whole, exactly the stock step on the same gradients; its factored
    states are replicated on every rank."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model, same_grads = shard_blocks(mlp_blocks()), mlp_blocks()
    opts = [torch.optim.Adafactor(m.parameters(), lr=0.01) for m in (model, same_grads)]
    for step in range(STEPS):
        train_steps(model, [], 1, rank, world, first=step)
        for p, q in zip(model.parameters(), same_grads.parameters()):
            q.grad = full_value(p.grad)
        for opt in opts:
            opt.step()
            opt.zero_grad()
    return max_diff(model, same_grads)


@pytest.mark.skipif(not hasattr(torch.optim, "Adafactor"), reason="torch.optim.Adafactor")
@pytest.mark.slow
def test_adafactor_steps_whole_matrices_exactly():
    assert run_distributed(_adafactor, 3) == [0.0, 0.0, 0.0]
