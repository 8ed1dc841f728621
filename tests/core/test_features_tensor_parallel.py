"""FSDP + tensor parallel on a 2-D (dp, tp) mesh at world size 4 (2 x 2), CPU/gloo.

Parameters that ``parallelize_module`` made DTensors on ``world_mesh["tp"]`` are
sharded over ``world_mesh["dp"]`` (Note [sharding a tensor-parallel parameter]). Each
test trains against a single-process reference on the same global batches.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                               SequenceParallel, parallelize_module)
from torch.distributed.tensor.placement_types import _StridedShard

import fullshard
from fullshard import checkpoint as ckpt
from fullshard import fully_shard
from fullshard.testing import run_distributed
from support.catalogue import matches_documented

STEPS = 4
SEQ, DIM, OUT = 6, 8, 8


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.w1 = nn.Linear(DIM, 12)
        self.w2 = nn.Linear(12, DIM)

    def forward(self, x):
        return x + self.w2(torch.relu(self.w1(self.norm(x))))


def _build() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(Block(), Block(), nn.Linear(DIM, OUT))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(4, SEQ, DIM, generator=g), torch.randn(4, SEQ, OUT, generator=g)


# "tp": Megatron column/row split of each block; norms and head stay plain tensors, so the
# model mixes DTensors on the (dp, tp) mesh with DTensors on the dp mesh.
# "sp": torchtitan's plan, sequence-parallel norms and a column-split head: every
# parameter is a TP DTensor, replicated norms get Partial gradients.
def _parallelize(model: nn.Sequential, tp_mesh, plan: str) -> None:
    if plan == "tp":
        block_plan = {"w1": ColwiseParallel(), "w2": RowwiseParallel()}
    else:
        block_plan = {"norm": SequenceParallel(), "w1": ColwiseParallel(input_layouts=Shard(1)),
                      "w2": RowwiseParallel(output_layouts=Shard(1))}
        parallelize_module(model[2], tp_mesh,
                           ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()))
    for block in model[:2]:
        parallelize_module(block, tp_mesh, block_plan)


def _sharded(plan: str, mesh):
    model = _build()
    _parallelize(model, mesh["tp"], plan)
    for block in model[:2]:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model


def _local_batch(step: int, mesh, plan: str):
    x, y = _batch(step)
    dp, tp = mesh["dp"].get_local_rank(), mesh["tp"].get_local_rank()
    x, y = x.chunk(2)[dp], y.chunk(2)[dp]
    if plan == "sp":  # the input arrives split on the sequence dimension
        x = x.chunk(2, dim=1)[tp].contiguous()
    return x, y


def _train_step(model, opt, step, mesh, plan) -> float:
    x, y = _local_batch(step, mesh, plan)
    ((model(x) - y) ** 2).mean().backward()
    norm = fullshard.clip_grad_norm_(model.parameters(), 0.5)
    opt.step()
    opt.zero_grad()
    return norm.item()


def _full(model) -> dict[str, torch.Tensor]:
    return {k: v.full_tensor() for k, v in model.state_dict().items()}


def _worker(plan: str, tmp: str):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = _sharded(plan, mesh)
    placements = {k: v.placements for k, v in model.state_dict().items()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    norms = [_train_step(model, opt, s, mesh, plan) for s in range(STEPS - 1)]
    ckpt.save(f"{tmp}/step{STEPS - 1}", model, opt)
    norms.append(_train_step(model, opt, STEPS - 1, mesh, plan))
    trained = _full(model)
    # resume: a fresh model and optimizer load the checkpoint and take the last step
    resumed = _sharded(plan, mesh)
    opt2 = torch.optim.AdamW(resumed.parameters(), lr=1e-2)
    ckpt.load(f"{tmp}/step{STEPS - 1}", resumed, opt2)
    _train_step(resumed, opt2, STEPS - 1, mesh, plan)
    # a full (unsharded) state dict loads back into the 2-D layout
    reloaded = _sharded(plan, mesh)
    options = ckpt.StateDictOptions(full_state_dict=True)
    ckpt.set_model_state_dict(reloaded, ckpt.get_model_state_dict(model, options=options),
                              options=options)
    return {"placements": placements, "norms": norms, "trained": trained,
            "resumed": _full(resumed), "reloaded": _full(reloaded)}


def _reference():
    model = _build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    norms = []
    for step in range(STEPS):
        x, y = _batch(step)
        ((model(x) - y) ** 2).mean().backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5).item())
        opt.step()
        opt.zero_grad()
    return norms, {k: v.detach() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("plan", ["tp", "sp"])
@pytest.mark.slow
def test_fsdp_with_tensor_parallel_matches_single_process(plan, tmp_path):
    results = run_distributed(_worker, 4, plan, str(tmp_path))
    ref_norms, ref_params = _reference()
    for rank, out in enumerate(results):
        assert out["norms"] == pytest.approx(ref_norms, rel=1e-5), rank
        for key, ref in ref_params.items():
            for what in ("trained", "resumed", "reloaded"):
                torch.testing.assert_close(out[what][key], ref, atol=2e-6, rtol=1e-5,
                                           msg=f"rank {rank} {what} {key}")
    # the same DTensor layout torch's fully_shard gives (state dicts interchangeable)
    placements = results[0]["placements"]
    assert placements["0.w1.weight"] == (_StridedShard(0, split_factor=2), Shard(0))
    assert placements["0.w2.weight"] == (Shard(0), Shard(1))
    assert placements["0.w2.bias"] == (Shard(0), Replicate())
    if plan == "tp":
        assert placements["0.norm.weight"] == (Shard(0),)
    else:
        assert placements["0.norm.weight"] == (Shard(0), Replicate())


def _raised(fn) -> str:
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - the message is what is checked
        return f"{type(err).__name__}: {err}"
    return "NO ERROR RAISED"


def _misuse_worker():
    errors = {}
    world = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = _build()
    _parallelize(model, world["tp"], "tp")
    # a data-parallel mesh that is not another dimension of the TP mesh's mesh
    flat = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    errors["E45"] = _raised(lambda: fully_shard(model[0], mesh=flat))
    # the TP mesh given as the data-parallel one
    errors["E46"] = _raised(lambda: fully_shard(model[1], mesh=world["tp"]))
    tall = init_device_mesh("cpu", (4, 1), mesh_dim_names=("dp", "tp"))
    model = _build()
    _parallelize(model, tall["tp"], "tp")
    # hpZ: reshard to groups of 2 of the 4 data-parallel ranks after forward
    errors["E47"] = _raised(lambda: fully_shard(model[1], mesh=tall["dp"],
                                                reshard_after_forward=2))
    dist.barrier()
    return errors


@pytest.mark.slow
def test_misuse_names_the_parameter_and_what_to_do():
    for code, message in run_distributed(_misuse_worker, 4)[0].items():
        assert matches_documented(code, message), (code, message)


# -- torch 2.13's spelling: the whole mesh plus dp_mesh_dims ----------------------------------
class _MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(DIM, 12)
        self.w2 = nn.Linear(12, DIM)

    def forward(self, x):
        return self.w2(torch.relu(self.w1(x)))


_SPMD_TP = {"w1.weight": Shard(0), "w1.bias": Shard(0), "w2.weight": Shard(1),
            "w2.bias": Replicate()}


def _spmd_model(world):
    torch.manual_seed(0)
    model = _MLP()
    for name, p in list(model.named_parameters()):  # DTensors on the whole (dp, tp) mesh
        module, attr = name.split(".")
        setattr(getattr(model, module), attr, nn.Parameter(
            distribute_tensor(p.detach(), world, (Replicate(), _SPMD_TP[name]))))
    fully_shard(model, mesh=world, dp_mesh_dims=fullshard.DataParallelMeshDims(shard="dp"))
    return model


def _spmd_step(model, opt, step, world):
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(4, DIM, generator=g), torch.randn(4, DIM, generator=g)
    dp = world["dp"].get_local_rank()
    as_local = (Replicate(), Replicate())  # each data-parallel rank's own batch
    x = DTensor.from_local(x.chunk(2)[dp], world, as_local)
    y = DTensor.from_local(y.chunk(2)[dp], world, as_local)
    ((model(x) - y) ** 2).mean().backward()
    opt.step()
    opt.zero_grad()


def _spmd_worker(tmp: str):
    world = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = _spmd_model(world)
    placements = {k: v.placements for k, v in model.state_dict().items()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(STEPS - 1):
        _spmd_step(model, opt, step, world)
    ckpt.save(f"{tmp}/spmd", model, opt)
    _spmd_step(model, opt, STEPS - 1, world)
    resumed = _spmd_model(world)
    opt2 = torch.optim.AdamW(resumed.parameters(), lr=1e-2)
    ckpt.load(f"{tmp}/spmd", resumed, opt2)
    _spmd_step(resumed, opt2, STEPS - 1, world)
    plain = _raised(lambda: fully_shard(
        _MLP(), mesh=world, dp_mesh_dims=fullshard.DataParallelMeshDims(shard="dp")))
    return placements, _full(model), _full(resumed), plain


@pytest.mark.slow
def test_dp_mesh_dims_on_the_whole_mesh_matches_single_process(tmp_path):
    placements, trained, resumed, plain = run_distributed(_spmd_worker, 4, str(tmp_path))[0]
    torch.manual_seed(0)
    model = _MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(STEPS):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(4, DIM, generator=g), torch.randn(4, DIM, generator=g)
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
    for key, ref in model.state_dict().items():
        torch.testing.assert_close(trained[key], ref, atol=2e-6, rtol=1e-5, msg=key)
        torch.testing.assert_close(resumed[key], ref, atol=2e-6, rtol=1e-5, msg=key)
    assert placements["w1.weight"] == (_StridedShard(0, split_factor=2), Shard(0))
    assert placements["w2.weight"] == (Shard(0), Shard(1))
    assert placements["w2.bias"] == (Shard(0), Replicate())
    assert matches_documented("E48", plain), plain
