"""CPU offload: shards, gradients and optimizer states in CPU memory, copied to the
compute device for each gather. On a CPU-only machine both devices are the CPU and
the same copies run, so parity checks the offload path itself."""

import os

import pytest
import torch
import torch.distributed as dist

from fullshard import CPUOffload, CPUOffloadPolicy, FSDP, MixedPrecisionPolicy, fully_shard
from fullshard.testing import models as m
from fullshard.testing import run_distributed
from fullshard.testing.models import token_batch
from fullshard.testing.parity import check_parity
from fullshard.gpt import GPT, Block, GPTConfig, lm_loss
from fullshard.wrap import ModuleWrapPolicy

CFG = GPTConfig(vocab_size=40, seq_len=10, d_model=16, n_layers=2, n_heads=2)


def _batch(step, n=8):
    return token_batch(step, n, CFG.vocab_size, CFG.seq_len)


def _offload_fully_shard(model, merge):
    policy = CPUOffloadPolicy(pin_memory=False)
    for layer in model.layers:
        fully_shard(layer, offload_policy=policy)
    fully_shard(model, offload_policy=policy)
    if not merge:
        model.set_bucket_numel(0)


def _parity_fully_shard(merge):
    report = check_parity(lambda: GPT(CFG), lambda model: _offload_fully_shard(model, merge),
                          _batch, lambda model, b: lm_loss(model(b[0]), b[1]), steps=4)
    return report.max_weight_diff


def test_offload_parity_fully_shard():
    run_distributed(_parity_fully_shard, 2, True)
    run_distributed(_parity_fully_shard, 2, False)


def _offload_where_things_live():
    model = FSDP(GPT(CFG), auto_wrap_policy=ModuleWrapPolicy({Block}),
                 cpu_offload=CPUOffload(offload_params=True))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = _batch(dist.get_rank(), 2)
    lm_loss(model(x), y).backward()
    opt.step()
    group = model.layers[0]._unit.group
    checks = {
        "offloaded": group.offload is not None,
        "shards_cpu": all(p.to_local().device.type == "cpu" for p in model.parameters()),
        "grads_cpu": all(p.grad.to_local().device.type == "cpu" for p in model.parameters()),
        "states_cpu": all(v.device.type == "cpu" for s in opt.state.values()
                          for v in s.values() if torch.is_tensor(v) and v.dim() > 0),
        # the gathered copy is a separate buffer on the compute device
        "separate_unsharded": group.unsharded.built
        and group.unsharded.tensor.untyped_storage().data_ptr() != group.flat_shard.data_ptr(),
    }
    return checks


def test_offload_keeps_state_on_cpu():
    for checks in run_distributed(_offload_where_things_live, 2):
        assert all(checks.values()), checks


def _parity_offload_mixed_precision():
    def shard(model):
        policy = MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)
        fully_shard(model.blocks[0], mp_policy=policy, offload_policy=CPUOffloadPolicy())
        fully_shard(model, mp_policy=policy, offload_policy=CPUOffloadPolicy())

    check_parity(m.OddMLP, shard, lambda s: m.float_batch(s, 8, 7, 3), m.mse_loss,
                 steps=3, rtol=2e-2, atol=2e-3)


def test_offload_with_mixed_precision_parity():
    run_distributed(_parity_offload_mixed_precision, 2)


def _parity_fsdp1_offload(strategy_name):
    from fullshard import ShardingStrategy

    os.environ["LOCAL_WORLD_SIZE"] = "2"
    strategy = ShardingStrategy[strategy_name]
    report = check_parity(
        lambda: GPT(CFG),
        lambda model: FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}),
                           sharding_strategy=strategy, cpu_offload=CPUOffload(True)),
        _batch, lambda model, b: lm_loss(model(b[0]), b[1]), steps=3)
    return report.max_weight_diff


@pytest.mark.parametrize("strategy,world", [("NO_SHARD", 2), ("SHARD_GRAD_OP", 2),
                                            ("HYBRID_SHARD", 4)])
@pytest.mark.slow
def test_offload_with_each_strategy_parity(strategy, world):
    run_distributed(_parity_fsdp1_offload, world, strategy)
