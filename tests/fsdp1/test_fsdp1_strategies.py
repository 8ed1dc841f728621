"""FullyShardedDataParallel's sharding strategies: parity with single-process training,
and the memory and collectives each strategy promises."""

import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate, Shard

from fullshard import FSDP, BackwardPrefetch, ShardingStrategy
from fullshard.testing import run_distributed
from fullshard.testing.models import token_batch
from fullshard.testing.counting import count_forward_backward
from fullshard.testing.parity import check_parity
from fullshard.gpt import GPT, Block, GPTConfig, lm_loss
from fullshard.wrap import ModuleWrapPolicy

CFG = GPTConfig(vocab_size=48, seq_len=12, d_model=24, n_layers=3, n_heads=4)
POLICY = ModuleWrapPolicy({Block})


def _batch(step, n=8):
    return token_batch(step, n, CFG.vocab_size, CFG.seq_len)


def _loss(model, batch):
    return lm_loss(model(batch[0]), batch[1])


def _wrap(model, strategy, **kwargs):
    model = FSDP(model, auto_wrap_policy=POLICY, sharding_strategy=strategy, **kwargs)
    model.set_bucket_numel(0)  # one collective per unit, so the counts below are per unit
    return model


def _parity(strategy_name, kwargs):
    os.environ["LOCAL_WORLD_SIZE"] = "2"  # hybrid: 2 "nodes" of 2 ranks at world size 4
    strategy = ShardingStrategy[strategy_name]
    report = check_parity(lambda: GPT(CFG), lambda m: _wrap(m, strategy, **kwargs), _batch,
                          _loss, optimizer="sgd", steps=4)
    return report.max_weight_diff


@pytest.mark.parametrize("strategy,world", [
    ("FULL_SHARD", 2), ("SHARD_GRAD_OP", 2), ("ZERO1", 2), ("NO_SHARD", 2),
    ("HYBRID_SHARD", 4), ("_HYBRID_SHARD_ZERO2", 4)])
@pytest.mark.slow
def test_strategy_parity(strategy, world):
    run_distributed(_parity, world, strategy, {})


@pytest.mark.parametrize("kwargs", [
    {"forward_prefetch": True},
    {"backward_prefetch": BackwardPrefetch.BACKWARD_POST},
    {"backward_prefetch": None, "limit_all_gathers": False, "use_orig_params": True}],
    ids=["forward_prefetch", "backward_post", "no_prefetch"])
@pytest.mark.slow
def test_prefetch_options_parity(kwargs):
    run_distributed(_parity, 2, "FULL_SHARD", kwargs)


def _promises(strategy_name):
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    strategy = ShardingStrategy[strategy_name]
    world = dist.get_world_size()
    torch.manual_seed(0)
    model = _wrap(GPT(CFG), strategy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = _batch(dist.get_rank(), 2)
    for _ in range(2):  # the second step is the steady state
        fwd, bwd = count_forward_backward(lambda: lm_loss(model(x), y))
        opt.step()
        opt.zero_grad()
    units = 1 + CFG.n_layers
    w = model.layers[0].mlp.fc.weight
    rows = w.shape[0]
    local_rows = w.to_local().shape[0]
    out = {"fwd": fwd, "bwd": bwd, "rows": rows, "local_rows": local_rows,
           "units": units, "world": world, "placements": [str(p) for p in w.placements]}
    group = model.layers[0]._unit.group
    out["aliases"] = group.unsharded.is_shard
    return out


def test_full_shard_gathers_in_forward_and_backward():
    r = run_distributed(_promises, 2, "FULL_SHARD")[0]
    assert r["local_rows"] == r["rows"] // 2
    assert r["fwd"].get("all_gather", 0) == r["units"]  # forward_prefetch=False: blocking
    # backward gathers every layer again (the root stays gathered); no all-reduce
    assert r["bwd"].get("all_gather", 0) + r["bwd"].get("all_gather_async", 0) == CFG.n_layers
    assert r["bwd"]["reduce_scatter"] == r["units"] and "all_reduce" not in r["bwd"]


@pytest.mark.slow
def test_shard_grad_op_does_not_gather_in_backward():
    r = run_distributed(_promises, 2, "SHARD_GRAD_OP")[0]
    assert r["local_rows"] == r["rows"] // 2
    assert r["bwd"].get("all_gather", 0) + r["bwd"].get("all_gather_async", 0) == 0
    assert r["bwd"]["reduce_scatter"] == r["units"]


def test_no_shard_holds_full_parameters_and_only_all_reduces():
    r = run_distributed(_promises, 2, "NO_SHARD")[0]
    assert r["local_rows"] == r["rows"] and r["aliases"]  # held once, not gathered
    assert r["placements"] == [str(Replicate()), str(Shard(0))]
    assert r["fwd"] == {} and r["bwd"] == {"all_reduce": r["units"]}


@pytest.mark.slow
def test_hybrid_shards_within_node_and_all_reduces_across():
    r = run_distributed(_promises, 4, "HYBRID_SHARD")[0]
    assert r["local_rows"] == r["rows"] // 2  # 2 ranks per "node"
    assert r["bwd"]["reduce_scatter"] == r["units"] and r["bwd"]["all_reduce"] == r["units"]
    assert r["bwd"].get("all_gather", 0) + r["bwd"].get("all_gather_async", 0) == CFG.n_layers
    r2 = run_distributed(_promises, 4, "_HYBRID_SHARD_ZERO2")[0]
    assert r2["bwd"].get("all_gather", 0) + r2["bwd"].get("all_gather_async", 0) == 0
