"""Units on different meshes in one model: experts sharded on their own mesh (expert
parallel x FSDP, as torchtitan lays MoE models out) beside dense layers on the whole
data-parallel mesh, against a single-process reference that computes every expert.

The world mesh is ``(efsdp, ep)``: each expert weight is a DTensor ``Shard(0)`` on
``ep`` (fullshard.testing.experts.expert_parallel), the experts' unit shards its local
piece over ``efsdp``, and the dense units use the flattened mesh of all ranks (or the
2-D mesh, hybrid). An expert's gradient arrives through the all-to-alls summed over its
``ep`` group, so the experts' units divide by the whole data-parallel size
(``set_gradient_divide_factor``), as torchtitan's do.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard

from support.catalogue import matches_documented, message_of
from fullshard import checkpoint as ckpt
from fullshard import fully_shard
from fullshard.testing import run_distributed
from fullshard.testing import models as m
from fullshard.testing.experts import ExpertModel, expert_parallel
from fullshard.testing.parity import check_parity, make_optimizer

STEPS = 5

# name: (world size, ExpertModel arguments, (efsdp, ep) sizes, how the experts are sharded,
# how the dense units are sharded)
LAYOUTS = {
    # 4 experts, 2 per ep rank, each rank's pair sharded over 2 efsdp ranks
    "ep2xefsdp2": (4, {}, (2, 2), "ep", "flat"),
    # one expert per ep rank: Shard(1) (the hidden dim) over efsdp, as torchtitan does
    # when the shard ranks outnumber the experts
    "ep2xefsdp2_shard1": (4, {"n_experts": 2}, (2, 2), "ep_shard1", "flat"),
    # 3 local experts over 2 shard ranks (padded dim 0), odd widths everywhere
    "ep2xefsdp2_uneven": (4, {"n_experts": 6, "dim": 7, "hidden": 5, "top_k": 3}, (2, 2),
                          "ep", "flat"),
    # dense units hybrid-sharded on the 2-D mesh (replicated across efsdp, sharded on ep)
    "ep2xefsdp2_hsdp_dense": (4, {}, (2, 2), "ep", "hybrid"),
    # no expert parallelism: the experts hybrid-sharded on the 2-D mesh, dense flat
    "experts_hybrid": (4, {}, (2, 2), "hybrid", "flat"),
    # experts wholly expert parallel: their unit's mesh is one rank
    "ep2xefsdp1": (2, {}, (1, 2), "ep", "flat"),
    # no expert parallelism, one expert: Shard(1) inside the dense block's unit
    "shard1_in_block": (2, {"n_experts": 1, "top_k": 1}, (2, 1), "in_block_shard1", "flat"),
    # torchtitan's expert-parallel call: one fully_shard per block, the experts put on
    # efsdp by shard_placement_fn (torch 2.13's ShardPlacementResult)
    "ep2xefsdp2_one_call": (4, {}, (2, 2), "ep_in_call", "flat"),
}


def _placement_results(world, dp, expert_params: set):
    """torchtitan's shard_placement_fn for an MoE block under expert parallelism."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import (FSDPMeshInfo,
                                                                  ShardPlacementResult)
    experts = FSDPMeshInfo(world["efsdp"], shard_mesh_dim=0)
    dense = FSDPMeshInfo(dp, shard_mesh_dim=0)
    return lambda p: ShardPlacementResult(placement=Shard(0), mesh_info=(
        experts if p in expert_params else dense))


def _meshes(efsdp: int, ep: int):
    world = init_device_mesh("cpu", (efsdp, ep), mesh_dim_names=("efsdp", "ep"))
    return world, world._flatten("dp")


def _shard(model: ExpertModel, layout: str) -> None:
    """Shard ``model`` as LAYOUTS[layout] says, blocks and experts bottom-up."""
    _, _, (efsdp, ep), experts_how, dense_how = LAYOUTS[layout]
    world, dp = _meshes(efsdp, ep)
    dense_mesh = world if dense_how == "hybrid" else dp
    if experts_how.startswith("ep"):
        expert_parallel(model, world["ep"])
    for block in model.blocks:
        experts = block.moe.experts
        if experts_how in ("ep", "ep_shard1"):
            placement = (lambda p: Shard(1)) if experts_how == "ep_shard1" else None
            fully_shard(experts, mesh=world["efsdp"], shard_placement_fn=placement)
            experts.set_gradient_divide_factor(dist.get_world_size())
        elif experts_how == "hybrid":
            fully_shard(experts, mesh=world)
        expert_params = set(experts.parameters())
        if experts_how == "ep_in_call":  # Note [parameters on meshes of their own]
            fully_shard(block, mesh=dense_mesh,
                        shard_placement_fn=_placement_results(world, dp, expert_params))
            # reaches the experts' unit too, as FSDP2's reaches every group of the call
            block.set_gradient_divide_factor(dist.get_world_size())
            continue
        fully_shard(block, mesh=dense_mesh,
                    shard_placement_fn=lambda p: Shard(1) if p in expert_params else None)
    fully_shard(model, mesh=dense_mesh)


def _batch(step: int, n: int = 8):
    return m.float_batch(step, n, 5, 3)


def _parity(layout: str) -> list[tuple[float, float]]:
    kwargs = LAYOUTS[layout][1]
    return check_parity(lambda: ExpertModel(**kwargs), lambda model: _shard(model, layout),
                        _batch, m.mse_loss, optimizer="sgd", steps=STEPS).losses


# ep2xefsdp2 and experts_hybrid run in the test of an expert without tokens below; the
# rarer layouts in the extended lane keep `make test` within its time
_EXTENDED = {"ep2xefsdp2_uneven", "ep2xefsdp1", "shard1_in_block", "ep2xefsdp2_one_call"}


@pytest.mark.slow
@pytest.mark.parametrize("layout", [
    pytest.param(name, marks=pytest.mark.extended) if name in _EXTENDED else name
    for name in LAYOUTS if name not in ("ep2xefsdp2", "experts_hybrid")])
def test_experts_on_their_own_mesh_train_as_one_process(layout):
    if layout == "ep2xefsdp2_one_call" and not _has_placement_results():
        pytest.skip("this torch has no ShardPlacementResult")
    losses = run_distributed(_parity, LAYOUTS[layout][0], layout)[0]
    assert len(losses) == STEPS


def _gathered_with_the_block() -> list[tuple]:
    """The experts' mesh dims after ``block.unshard()`` and ``block.reshard()``: the
    split-off unit is gathered and freed with the call's unit."""
    torch.manual_seed(0)
    model = ExpertModel()
    _shard(model, "ep2xefsdp2_one_call")
    with torch.no_grad():
        model(_batch(0)[0][:2])
    block = model.blocks[0]
    seen = [block.moe.experts.w1.device_mesh.mesh_dim_names]
    block.unshard()
    seen.append(block.moe.experts.w1.device_mesh.mesh_dim_names)
    block.reshard()
    seen.append(block.moe.experts.w1.device_mesh.mesh_dim_names)
    return seen


@pytest.mark.slow
@pytest.mark.extended
def test_unsharding_a_block_gathers_its_experts_on_their_own_mesh():
    if not _has_placement_results():
        pytest.skip("this torch has no ShardPlacementResult")
    for seen in run_distributed(_gathered_with_the_block, 4):
        assert seen == [("efsdp", "ep"), ("ep",), ("efsdp", "ep")], seen


def _has_placement_results() -> bool:
    from torch.distributed.fsdp._fully_shard import _fsdp_common
    return hasattr(_fsdp_common, "ShardPlacementResult")


def _sharded_layout(layout: str) -> dict:
    kwargs = LAYOUTS[layout][1]
    torch.manual_seed(0)
    model = ExpertModel(**kwargs)
    _shard(model, layout)
    experts = model.blocks[0].moe.experts
    return {"w1": (type(experts.w1).__name__, experts.w1.device_mesh.mesh_dim_names,
                   tuple(experts.w1.placements), tuple(experts.w1.to_local().shape))}


@pytest.mark.slow
@pytest.mark.extended
def test_expert_weights_are_sharded_on_the_joint_mesh():
    # (efsdp, ep): the local experts split over efsdp inside each ep piece
    w1 = run_distributed(_sharded_layout, 4, "ep2xefsdp2")[0]["w1"]
    assert w1[0] == "DTensor" and w1[1] == ("efsdp", "ep")
    assert repr(w1[2][1]) == repr(Shard(0)) and "StridedShard" in type(w1[2][0]).__name__
    assert w1[3] == (1, 6, 8)  # 4 experts / 2 ep ranks / 2 efsdp ranks
    w1 = run_distributed(_sharded_layout, 4, "ep2xefsdp2_shard1")[0]["w1"]
    assert w1[2] == (Shard(1), Shard(0)) and w1[3] == (1, 3, 8)


# -- an expert that gets no tokens on some ranks -----------------------------------------
def _starved_expert_model() -> ExpertModel:
    """Expert 0 is chosen by every token whose first input feature is negative and by
    none whose feature is positive (_split_batch puts those on the second half of the
    ranks), so it gets no tokens at all on the ranks of the second half."""
    model = ExpertModel()
    with torch.no_grad():
        model.inp.weight[0].zero_()
        model.inp.weight[0, 0] = 3.0
        model.inp.bias[0] = 0.0
        for block in model.blocks:
            block.norm.weight.fill_(1.0)
            block.moe.router.weight[0].zero_()
            block.moe.router.weight[0, 0] = -40.0
    return model


def _split_batch(step: int):
    x, y = _batch(step)
    half = x.shape[0] // 2
    x[:half, 0] = -2.0 - x[:half, 0].abs()
    x[half:, 0] = 2.0 + x[half:, 0].abs()
    return x, y


def _starved(layout: str) -> list[tuple[float, float]]:
    return check_parity(_starved_expert_model, lambda model: _shard(model, layout),
                        _split_batch, m.mse_loss, optimizer="sgd", steps=STEPS).losses


def _counts_of_expert_zero(layout: str) -> int:
    torch.manual_seed(1234)
    model = _starved_expert_model()
    _shard(model, layout)
    x, _ = _split_batch(0)
    n = x.shape[0] // dist.get_world_size()
    model(x[dist.get_rank() * n:(dist.get_rank() + 1) * n])
    # the experts of the first ep rank hold expert 0 (Shard(0) on ep)
    return model.blocks[0].moe.experts.counts[0]


@pytest.mark.slow
@pytest.mark.parametrize("layout", [
    "ep2xefsdp2", pytest.param("experts_hybrid", marks=pytest.mark.extended),
    pytest.param("ep2xefsdp2_one_call", marks=pytest.mark.extended)])
def test_an_expert_without_tokens_on_some_ranks_trains_as_one_process(layout):
    if layout == "ep2xefsdp2_one_call" and not _has_placement_results():
        pytest.skip("this torch has no ShardPlacementResult")
    counts = run_distributed(_counts_of_expert_zero, 4, layout)
    if layout != "experts_hybrid":  # ranks 0 and 2 hold expert 0; rank 2's ep group: 2nd half
        assert counts[0] > 0 and counts[2] == 0
    else:  # every rank computes expert 0 on its own tokens
        assert counts[0] > 0 and counts[1] > 0 and counts[2] == counts[3] == 0
    run_distributed(_starved, 4, layout)


# -- the default divisor of a unit on a sub-mesh ----------------------------------------
def _grads_without_divide_factor() -> dict[str, float]:
    torch.manual_seed(0)
    model = ExpertModel()
    reference = ExpertModel()
    reference.load_state_dict(model.state_dict())
    world, dp = _meshes(2, 2)
    expert_parallel(model, world["ep"])
    for block in model.blocks:
        fully_shard(block.moe.experts, mesh=world["efsdp"])
        fully_shard(block, mesh=dp)
    fully_shard(model, mesh=dp)
    x, y = _batch(0)
    n, rank = x.shape[0] // 4, dist.get_rank()
    m.mse_loss(model, (x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n])).backward()
    m.mse_loss(reference, (x, y)).backward()
    ref = dict(reference.named_parameters())
    # sharded gradient / reference gradient, per parameter
    return {name: (p.grad.full_tensor().norm() / ref[name].grad.norm()).item()
            for name, p in model.named_parameters()}


@pytest.mark.slow
def test_a_unit_on_a_sub_mesh_divides_by_its_own_mesh_size():
    # torch's rule: each unit averages over its own data-parallel ranks. The experts'
    # gradients are sums over the 4 ranks' tokens averaged over their 2 efsdp ranks:
    # twice the reference's until set_gradient_divide_factor(4); dense ones are exact
    ratios = run_distributed(_grads_without_divide_factor, 4)[0]
    for name, ratio in ratios.items():
        expected = 2.0 if ".experts." in name else 1.0
        assert ratio == pytest.approx(expected, rel=1e-5), name


# -- resume ------------------------------------------------------------------------------
def _train(model, opt, steps: range) -> list[float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for step in steps:
        x, y = _batch(step)
        n = x.shape[0] // world
        loss = m.mse_loss(model, (x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _built(layout: str):
    torch.manual_seed(1234)
    model = ExpertModel(**LAYOUTS[layout][1])
    _shard(model, layout)
    return model, make_optimizer("sgd", model.parameters(), 0.05)


def _resume(path: str, layout: str):
    model, opt = _built(layout)
    _train(model, opt, range(2))
    ckpt.save(os.path.join(path, "step_2"), model, opt)
    straight = _train(model, opt, range(2, 5))
    final = {k: v.full_tensor() for k, v in model.state_dict().items()}
    model, opt = _built(layout)  # a fresh model: nothing carried over but the checkpoint
    ckpt.load(os.path.join(path, "step_2"), model, opt)
    resumed = _train(model, opt, range(2, 5))
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v.full_tensor(), final[k], rtol=1e-5, atol=1e-6,
                                   msg=lambda msg, k=k: f"{k}: {msg}")
    return straight, resumed


@pytest.mark.slow
@pytest.mark.parametrize("layout", [
    "ep2xefsdp2", pytest.param("ep2xefsdp2_shard1", marks=pytest.mark.extended),
    pytest.param("ep2xefsdp2_one_call", marks=pytest.mark.extended)])
def test_a_resumed_expert_parallel_run_continues_like_a_straight_one(tmp_path, layout):
    if layout == "ep2xefsdp2_one_call" and not _has_placement_results():
        pytest.skip("this torch has no ShardPlacementResult")
    for straight, resumed in run_distributed(_resume, 4, str(tmp_path / layout), layout):
        assert resumed == pytest.approx(straight, rel=1e-5)


# -- meshes that do not fit --------------------------------------------------------------
def _misfits() -> dict[str, str]:
    world, dp = _meshes(2, 2)
    x = _batch(0)[0][:2]

    def run(shard):
        torch.manual_seed(0)
        model = ExpertModel()
        shard(model)
        model(x)

    def outside_the_root(model):  # the root on ranks {r, r^1}, the experts on {r, r^2}
        for block in model.blocks:
            fully_shard(block.moe.experts, mesh=world["efsdp"])
        fully_shard(model, mesh=world["ep"])

    def plain_on_a_sub_mesh(model):  # no expert parallelism: copies on the other ranks
        for block in model.blocks:
            fully_shard(block.moe.experts, mesh=world["efsdp"])
        fully_shard(model, mesh=dp)

    return {"E210": message_of(lambda: run(outside_the_root)),
            "E211": message_of(lambda: run(plain_on_a_sub_mesh))}


@pytest.mark.slow
def test_meshes_that_do_not_fit_are_one_line_naming_the_unit_and_the_meshes():
    for rank, messages in enumerate(run_distributed(_misfits, 4)):
        for code, message in messages.items():
            assert matches_documented(code, message), f"rank {rank} {code}: {message}"


def _own_mesh_placement() -> str:
    """A LayerNorm's weight on the experts' mesh, its bias on the block's: no submodule
    holds the one without the other (Note [parameters on meshes of their own])."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import (FSDPMeshInfo,
                                                                  ShardPlacementResult)
    world, dp = _meshes(1, 2)
    model = ExpertModel()
    block = model.blocks[0]
    experts = FSDPMeshInfo(world["ep"], shard_mesh_dim=0)
    return message_of(lambda: fully_shard(
        block, mesh=dp, shard_placement_fn=lambda p: ShardPlacementResult(
            placement=Shard(0), mesh_info=experts) if p is block.norm.weight else None))


@pytest.mark.slow
def test_a_module_with_parameters_on_two_meshes_is_refused_naming_the_parameter():
    # torch 2.13's per-parameter meshes (shard_placement_fn returning ShardPlacementResult)
    fsdp_common = pytest.importorskip("torch.distributed.fsdp._fully_shard._fsdp_common")
    if not hasattr(fsdp_common, "ShardPlacementResult"):
        pytest.skip("this torch has no ShardPlacementResult")
    for message in run_distributed(_own_mesh_placement, 2):
        assert matches_documented("E212", message), message
