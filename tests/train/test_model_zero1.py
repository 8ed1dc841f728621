"""ZeRO-1 (Note [ZeRO-1 is ZeRO-2 keeping the gathered storage] in train/model.py):
parameters gathered all the time and re-gathered after each step, gradients and
optimizer states sharded. Parity with one process, the gathered parameters at fixed
addresses, its memory in the estimate, and its misuse in the trainer."""

import pytest
import torch

from fullshard import fully_shard
from fullshard.core.state import unit_of
from fullshard.memory import estimate
from fullshard.testing import models as m
from fullshard.testing import run_distributed
from fullshard.testing.parity import check_parity
from fullshard.train.config.schema import ConfigError, get_preset, validate
from fullshard.train.config.flags import apply_overrides


def _zero1(model):
    for block in model.blocks:
        fully_shard(block, reshard_after_forward=False)
    fully_shard(model, reshard_after_forward=False)
    model.set_keep_unsharded_storage(True)


def _parity(micro_batches: int) -> dict:
    report = check_parity(m.OddMLP, _zero1, lambda s: m.float_batch(s, 8, 7, 3), m.mse_loss,
                          steps=4, optimizer="adamw", lr=1e-2, micro_batches=micro_batches)
    return {"losses": report.losses}


@pytest.mark.parametrize("world, micro_batches", [(2, 1), (4, 1), (2, 2)])
def test_zero1_trains_like_one_process(world, micro_batches):
    run_distributed(_parity, world, micro_batches)


def _addresses() -> dict:
    torch.manual_seed(0)
    model = m.OddMLP()
    _zero1(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    seen, values, kept = [], [], []
    for step in range(3):
        x, y = m.float_batch(step, 8, 7, 3)
        loss = m.mse_loss(model, (x, y))
        # the parameters the forward computed with, unsharded
        seen.append([p.data_ptr() for p in model.blocks[0].parameters()])
        loss.backward()
        opt.step()
        opt.zero_grad()
        values.append(model.blocks[0][0].weight.full_tensor().clone())
        # between steps the parameters are sharded DTensors, their gathered storage kept
        kept.append(unit_of(model.blocks[0]).group.unsharded.tensor.untyped_storage().size() > 0)
    return {"same_addresses": all(s == seen[0] for s in seen),
            "stepped": not torch.equal(values[0], values[-1]), "kept": all(kept)}


def test_gathered_parameters_keep_their_addresses_and_follow_each_step():
    for out in run_distributed(_addresses, 2):
        assert out["same_addresses"] and out["stepped"] and out["kept"], out


def test_estimate_holds_the_gathered_parameters_through_the_step():
    kw = dict(world_size=4, batch_size=2, seq_len=128, mp_policy=torch.bfloat16)
    zero2 = estimate("gpt2-124m", strategy="shard_grad_op", **kw)
    zero1 = estimate("gpt2-124m", strategy="zero1", **kw)
    full = estimate("gpt2-124m", strategy="full_shard", **kw)
    # forward is ZeRO-2's (every unit stays gathered); backward keeps the units it is done
    # with, and the optimizer step holds every unit gathered
    assert zero1.phase_peaks["forward"] == zero2.phase_peaks["forward"]
    assert zero1.phase_peaks["backward"] >= zero2.phase_peaks["backward"]
    gathered = 124_439_808 * 2  # every parameter in bf16 (unpadded; padding adds a little)
    extra = zero1.phase_peaks["optimizer"] - zero2.phase_peaks["optimizer"]
    assert gathered * 0.95 <= extra <= gathered * 1.05
    assert full.total < zero2.total <= zero1.total


def test_zero1_with_a_reshard_after_forward_that_frees_is_refused():
    cfg = get_preset("debug")
    for value in (True, 2):
        with pytest.raises(ConfigError, match="parallel.reshard_after_forward: .* zero1"):
            validate(apply_overrides(cfg, {"parallel.strategy": "zero1",
                                           "parallel.reshard_after_forward": value}, "test"))
