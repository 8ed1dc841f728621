"""NCCL's rules on gloo: each rule fires on two CPU ranks with an error naming the rank,
the collective and its number, and a correct fullshard training run passes under them."""

import pytest
import torch
import torch.distributed as dist

from fullshard import fully_shard
from fullshard.gpt import GPT, GPTConfig, lm_loss
from fullshard.testing import nccl_rules, run_distributed
from fullshard.testing.nccl_rules.signature import describe
from fullshard.testing.parity import check_parity

# torch >= 2.10 names it all_gather_single; older releases all_gather_into_tensor.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
CFG = GPTConfig(vocab_size=48, seq_len=12, d_model=24, n_layers=2, n_heads=4)


def _refusal(fn, *args):
    """What rank 0 and rank 1 raised, with the checker on."""
    with pytest.raises(AssertionError) as info:
        run_distributed(fn, 2, *args, timeout=60, nccl_rules=True)
    return str(info.value)


def _sizes_by_rank():
    dist.all_reduce(torch.ones(4))  # collective #0 agrees
    dist.all_reduce(torch.ones(10 + 10 * dist.get_rank()))


def test_different_sizes_across_ranks_are_refused_on_every_rank():
    report = _refusal(_sizes_by_rank)
    assert "2 of 2 ranks failed" in report
    assert "NCCL rule broken at collective #1 on group 'default_pg' (ranks [0, 1])" in report
    assert "rank 0 issued #1 allreduce([float32[10]], op=SUM)" in report
    assert "rank 1 issued #1 allreduce([float32[20]], op=SUM)" in report


def _order_by_rank():
    gather_out, summed = torch.empty(2, 4), torch.ones(4)
    calls = [lambda: _ALL_GATHER(gather_out, torch.ones(4)),
             lambda: dist.all_reduce(summed)]
    for call in calls if dist.get_rank() == 0 else reversed(calls):
        call()


def test_the_same_collectives_in_another_order_are_refused():
    report = _refusal(_order_by_rank)
    assert "collective #0" in report
    # the flat all-gather's method: all_gather_single from torch 2.13, _allgather_base before
    assert any(f"rank 0 issued #0 {name}(float32[2,4], float32[4])" in report
               for name in ("all_gather_single", "_allgather_base")), report
    assert "rank 1 issued #0 allreduce([float32[4]], op=SUM)" in report


def _dtype_by_rank():
    dist.broadcast(torch.ones(3, dtype=torch.float32 if dist.get_rank() else torch.bfloat16), 0)


def test_different_dtypes_are_refused():
    report = _refusal(_dtype_by_rank)
    assert "rank 0 issued #0 broadcast([bfloat16[3]], root=0)" in report
    assert "rank 1 issued #0 broadcast([float32[3]], root=0)" in report


def _reduce_op_by_rank():
    dist.all_reduce(torch.ones(2), op=dist.ReduceOp.MAX if dist.get_rank() else dist.ReduceOp.SUM)


def test_different_reduce_ops_are_refused():
    report = _refusal(_reduce_op_by_rank)
    assert "op=SUM" in report and "op=MAX" in report


def _object_with_a_device_tensor():
    dist.all_gather_object([None, None], {"step": 3, "state": torch.zeros(2, device="meta")})


def test_an_object_carrying_a_device_tensor_is_refused():
    report = _refusal(_object_with_a_device_tensor)
    assert "NCCL rule broken on rank 0: all_gather_object on group 'default_pg'" in report
    assert "rank 1: all_gather_object" in report and "meta tensor float32[2]" in report


def _objects_on_the_host():
    gathered = [None, None]
    dist.all_gather_object(gathered, {"rank": dist.get_rank(), "state": torch.ones(2)})
    return [g["rank"] for g in gathered]


def test_objects_holding_host_tensors_pass():
    assert run_distributed(_objects_on_the_host, 2, nccl_rules=True) == [[0, 1], [0, 1]]


def _host_tensor_on_the_device_group():
    nccl_rules.stands_for_device(dist.group.WORLD, "meta")
    dist.all_reduce(torch.ones(2))


def test_a_host_tensor_on_a_group_standing_for_devices_is_refused():
    report = _refusal(_host_tensor_on_the_device_group)
    assert ("NCCL rule broken on rank 1: collective #0 allreduce([float32[2]], op=SUM) on "
            "group 'default_pg' (ranks [0, 1]) passes a cpu tensor to a group that stands "
            "for meta devices") in report


def _subgroup_then_world():
    evens = dist.new_group([0])  # every rank creates it; only rank 0 uses it
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(5), group=evens)
    dist.all_reduce(torch.ones(3))
    return nccl_rules.enabled()


def test_collectives_that_match_pass_and_groups_count_apart():
    assert run_distributed(_subgroup_then_world, 2, nccl_rules=True) == [True, True]


def _train_a_sharded_gpt():
    def shard(model):
        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)

    def batch(step):
        x = torch.randint(0, CFG.vocab_size, (4, CFG.seq_len),
                          generator=torch.Generator().manual_seed(step))
        return x, torch.roll(x, -1, dims=1)

    report = check_parity(lambda: GPT(CFG), shard, batch,
                          lambda model, b: lm_loss(model(b[0]), b[1]), steps=3)
    return nccl_rules.enabled(), len(report.losses)


def test_a_correct_fullshard_training_run_passes_under_the_rules():
    assert run_distributed(_train_a_sharded_gpt, 2, nccl_rules=True) == [(True, 3)] * 2


def test_signatures_leave_out_what_may_differ_by_rank():
    # An uneven all-to-all's rows and a gather's root-only list differ by rank legitimately.
    assert (describe("all_to_all_single", (torch.empty(3, 4), torch.empty(5, 4), [1, 2], [2, 3]),
                     {}) == "all_to_all_single(float32[*,4], float32[*,4])")
    assert describe("gather", ([], [torch.empty(2)], dist.GatherOptions()), {}) == (
        "gather([float32[2]], root=0)")


def test_the_environment_turns_the_rules_on_and_an_explicit_choice_wins():
    assert nccl_rules.wanted(None, {nccl_rules.ENV: "1"}) and not nccl_rules.wanted(None, {})
    assert nccl_rules.wanted(True, {nccl_rules.ENV: "0"})
    assert not nccl_rules.wanted(False, {nccl_rules.ENV: "1"})
