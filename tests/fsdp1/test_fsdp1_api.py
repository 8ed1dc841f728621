"""FullyShardedDataParallel's API beyond training: state-dict types, summon_full_params,
clip_grad_norm_, mixed precision, ignored modules, meta-device init, errors."""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from fullshard import (FSDP, CPUOffload, FullStateDictConfig, FullyShardedDataParallel,
                       MixedPrecision, ShardingStrategy, StateDictType)
from fullshard.testing import run_distributed
from fullshard.testing.models import token_batch
from fullshard.testing.parity import local_slice
from fullshard.gpt import GPT, Block, GPTConfig, lm_loss
from fullshard.wrap import ModuleWrapPolicy

CFG = GPTConfig(vocab_size=40, seq_len=10, d_model=16, n_layers=2, n_heads=2)
POLICY = ModuleWrapPolicy({Block})


def _batch(step, n=4):
    return token_batch(step, n, CFG.vocab_size, CFG.seq_len)


def _trained(**kwargs):
    torch.manual_seed(0)
    model = FSDP(GPT(CFG), auto_wrap_policy=POLICY, **kwargs)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = _batch(dist.get_rank())
    lm_loss(model(x), y).backward()
    opt.step()
    return model, opt


def _state_dicts():
    model, opt = _trained()
    rank = dist.get_rank()
    out = {}
    assert isinstance(model, GPT) and isinstance(model, FullyShardedDataParallel)
    assert model.module is model and FSDP.fsdp_modules(model, root_only=True) == [model]
    sharded = {k: v.full_tensor() for k, v in model.state_dict().items()
               if isinstance(v, DTensor)}
    out["default_is_full"] = not sharded
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        shards = model.state_dict()
        out["sharded_are_dtensors"] = all(isinstance(v, DTensor) for k, v in shards.items()
                                          if "weight" in k or "bias" in k)
        full_from_shards = {k: v.full_tensor() for k, v in shards.items()}
    full = model.state_dict()  # FULL_STATE_DICT by default
    out["full_matches"] = all(torch.equal(full[k], full_from_shards[k]) for k in full)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                              FullStateDictConfig(offload_to_cpu=True, rank0_only=True)):
        only0 = model.state_dict()
    out["rank0_only"] = (len(only0) == len(full)) if rank == 0 else (only0 == {})
    # FULL load: every rank passes full tensors, each keeps its shard
    fresh = FSDP(GPT(GPTConfig(**{**CFG.__dict__})), auto_wrap_policy=POLICY)
    fresh.load_state_dict(full)
    with FSDP.state_dict_type(fresh, StateDictType.SHARDED_STATE_DICT):
        reloaded = {k: v.full_tensor() for k, v in fresh.state_dict().items()}
    out["full_load"] = all(torch.equal(reloaded[k], full[k]) for k in full)
    # optimizer state: full, keyed by name, loads back
    osd = FSDP.optim_state_dict(model, opt)
    out["optim_keys"] = sorted(osd["state"])[:2]
    opt2 = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    loadable = FSDP.optim_state_dict_to_load(fresh, opt2, osd)
    opt2.load_state_dict(loadable)
    a = next(iter(opt.state.values()))["exp_avg"]
    b = next(iter(opt2.state.values()))["exp_avg"]
    out["optim_roundtrip"] = torch.equal(a.to_local(), b.to_local())
    with pytest.raises(ValueError, match="LOCAL_STATE_DICT is not supported"):
        FSDP.set_state_dict_type(model, StateDictType.LOCAL_STATE_DICT)
    return out


def test_state_dict_types():
    for out in run_distributed(_state_dicts, 2):
        assert out.pop("optim_keys")[0].startswith("layers.0.")
        assert all(out.values()), out


def _summon_and_clip():
    model, _ = _trained()
    weight = model.layers[0].mlp.fc.weight
    before = weight.full_tensor()
    with FSDP.summon_full_params(model):
        w = model.layers[0].mlp.fc.weight
        assert not isinstance(w, DTensor) and torch.equal(w, before)
        w.data.add_(1.0)  # written back on exit
    assert torch.equal(model.layers[0].mlp.fc.weight.full_tensor(), before + 1)
    with FSDP.summon_full_params(model, writeback=False):
        model.layers[0].mlp.fc.weight.data.zero_()
    assert torch.equal(model.layers[0].mlp.fc.weight.full_tensor(), before + 1)
    with FSDP.summon_full_params(model, recurse=False):  # the root's own parameters only
        assert not isinstance(model.tok_emb.weight, DTensor)
        assert isinstance(model.layers[0].mlp.fc.weight, DTensor)
    with pytest.raises(ValueError, match="writeback=True with rank0_only=True"):
        with FSDP.summon_full_params(model, rank0_only=True):
            pass
    # clip_grad_norm_ against the reference on the global batch
    torch.manual_seed(0)
    reference = GPT(CFG)
    torch.manual_seed(0)
    model = FSDP(GPT(CFG), auto_wrap_policy=POLICY)
    x, y = _batch(100, 4)
    xs, ys = local_slice((x, y), dist.get_rank(), dist.get_world_size())
    lm_loss(model(xs), ys).backward()
    lm_loss(reference(x), y).backward()
    norm = model.clip_grad_norm_(0.1)
    ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.1)
    torch.testing.assert_close(norm, ref_norm, rtol=1e-5, atol=1e-6)
    g = model.layers[1].attn.qkv.weight.grad.full_tensor()
    torch.testing.assert_close(g, reference.layers[1].attn.qkv.weight.grad, rtol=1e-4, atol=1e-6)
    inf = model.clip_grad_norm_(1e9, norm_type=float("inf"))
    ref_inf = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1e9, norm_type="inf")
    torch.testing.assert_close(inf, ref_inf, rtol=1e-5, atol=1e-7)
    return True


def test_summon_full_params_and_clip_grad_norm():
    run_distributed(_summon_and_clip, 2)


class _WithNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 4))
        self.frozen_side = nn.Linear(6, 4)
        self.register_buffer("scale", torch.full((4,), 0.5))

    def forward(self, x):
        return self.scale * self.body(x) + self.frozen_side(x.float()).to(x.dtype)  # x: fp16


def _mixed_precision_and_ignored():
    torch.manual_seed(dist.get_rank())  # different weights per rank ...
    model = _WithNorm()
    side = model.frozen_side
    model = FSDP(model, sync_module_states=True,  # ... until rank 0's are broadcast
                 ignored_modules=[side],
                 mixed_precision=MixedPrecision(param_dtype=torch.float16,
                                                buffer_dtype=torch.float16))
    out = {}
    out["bn_unit"] = isinstance(model.body[1], FSDP)  # BatchNorm kept in full precision
    out["bn_params_fp32"] = model.body[1].weight.dtype == torch.float32
    out["bn_buffers_fp32"] = model.body[1].running_mean.dtype == torch.float32
    out["buffers_cast"] = model.scale.dtype == torch.float16
    out["buffers_saved_fp32"] = model.state_dict()["scale"].dtype == torch.float32
    out["ignored_plain"] = not isinstance(side.weight, DTensor)
    w = model.body[0].weight.full_tensor()
    gathered = [torch.empty_like(w) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, w)
    out["synced"] = all(torch.equal(gathered[0], g) for g in gathered)
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(dist.get_rank()))
    y = model(x)
    y.float().sum().backward()
    out["output_fp16"] = y.dtype == torch.float16
    # the ignored module's gradient is not reduced: it differs between ranks
    g = side.weight.grad.clone()
    dist.all_reduce(g)
    out["ignored_not_reduced"] = not torch.allclose(g, 2 * side.weight.grad)
    return out


def test_mixed_precision_buffers_batchnorm_ignored_and_sync():
    for out in run_distributed(_mixed_precision_and_ignored, 2):
        assert all(out.values()), out


def _meta_init():
    torch.manual_seed(0)
    reference = GPT(CFG)
    with torch.device("meta"):
        model = GPT(CFG)
    calls = []

    def param_init_fn(module):
        calls.append(type(module).__name__)
        module.to_empty(device=torch.device("cpu"), recurse=False)

    model = FSDP(model, auto_wrap_policy=POLICY, param_init_fn=param_init_fn)
    model.load_state_dict(reference.state_dict())  # FULL_STATE_DICT load of full tensors
    x, y = _batch(0)
    torch.testing.assert_close(lm_loss(model(x), y), lm_loss(reference(x), y))
    # without param_init_fn: empty on the device, then reset_parameters()
    with torch.device("meta"):
        plain = GPT(CFG)
    plain = FSDP(plain, auto_wrap_policy=POLICY)
    finite = all(torch.isfinite(p.to_local()).all() for p in plain.parameters())
    tied = plain.lm_head.weight is plain.tok_emb.weight
    return {"calls": "Block" in calls and "GPT" in calls, "finite": finite, "tied": tied}


def test_meta_device_init():
    for out in run_distributed(_meta_init, 2):
        assert all(out.values()), out


def _errors():
    def raises(fn, exc, pattern):
        with pytest.raises(exc, match=pattern):
            fn()

    raises(lambda: FSDP(nn.Linear(2, 2), sharding_strategy="FULL"), TypeError,
           r"sharding_strategy='FULL' is not one of ShardingStrategy.FULL_SHARD")
    raises(lambda: FSDP(nn.Linear(2, 2), mixed_precision=MixedPrecision(
        param_dtype=torch.float16, keep_low_precision_grads=True)), ValueError,
        r"keep_low_precision_grads=True\) is not supported")
    raises(lambda: FSDP(nn.Linear(2, 2), device_id=0), ValueError,
           "names a CUDA device but CUDA is not available")
    raises(lambda: FSDP(nn.Linear(2, 2), ignored_modules=[], ignored_states=[]), ValueError,
           "pass ignored_modules or ignored_states, not both")
    raises(lambda: FSDP(nn.Linear(2, 2), process_group=(dist.group.WORLD, dist.group.WORLD),
                        sharding_strategy=ShardingStrategy.HYBRID_SHARD), ValueError,
           "the process-group pair does not form a grid")
    raises(lambda: FSDP(nn.Linear(2, 2), auto_wrap_policy=3), TypeError,
           "auto_wrap_policy must be callable")
    raises(lambda: FSDP(nn.Linear(2, 2), cpu_offload=True), TypeError,
           "cpu_offload must be a fullshard.CPUOffload")
    model = FSDP(nn.Linear(2, 2), cpu_offload=CPUOffload())
    raises(lambda: FSDP(model), ValueError, "Linear is already sharded")
    with torch.device("meta"):
        meta = nn.Linear(2, 2)
    raises(lambda: FSDP(copy.deepcopy(meta), sync_module_states=True,
                        param_init_fn=lambda m: None), ValueError,
           "sync_module_states=True with Linear still on the meta device")
    return True


def test_misuse_errors():
    run_distributed(_errors, 2)


def _process_group_and_device_mesh():
    from torch.distributed.device_mesh import init_device_mesh

    rank = dist.get_rank()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    pair = pairs[rank // 2]
    torch.manual_seed(0)
    model = FSDP(GPT(CFG), auto_wrap_policy=POLICY, process_group=pair)
    w = model.layers[0].mlp.fc.weight
    x, y = _batch(rank // 2)  # each pair trains on its own data
    lm_loss(model(x), y).backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    full = w.full_tensor()  # gathered within the pair
    everyone = [torch.empty_like(full) for _ in range(4)]
    dist.all_gather(everyone, full)
    torch.manual_seed(0)
    on_mesh = FSDP(GPT(CFG), auto_wrap_policy=POLICY,
                   device_mesh=init_device_mesh("cpu", (4,)))
    # A 2-D mesh without dimension names, which torch's FSDP1 takes as (replicate, shard).
    hybrid = FSDP(GPT(CFG), auto_wrap_policy=POLICY, sharding_strategy=ShardingStrategy.HYBRID_SHARD,
                  device_mesh=init_device_mesh("cpu", (2, 2)))
    return {
        "sharded_in_pairs": w.to_local().shape[0] == w.shape[0] // 2,
        "pair_agrees": torch.equal(everyone[rank], everyone[rank ^ 1]),
        "pairs_differ": not torch.equal(everyone[0], everyone[2]),
        "mesh_quarters": on_mesh.layers[0].mlp.fc.weight.to_local().shape[0] == w.shape[0] // 4,
        "unnamed_hybrid_mesh_halves":
            hybrid.layers[0].mlp.fc.weight.to_local().shape[0] == w.shape[0] // 2,
    }


@pytest.mark.slow
def test_process_group_and_device_mesh_arguments():
    for out in run_distributed(_process_group_and_device_mesh, 4):
        assert all(out.values()), out


def _torch_option_types():
    from torch.distributed import fsdp as tfsdp

    model = FSDP(GPT(CFG), auto_wrap_policy=POLICY,
                 sharding_strategy=tfsdp.ShardingStrategy.SHARD_GRAD_OP,
                 mixed_precision=tfsdp.MixedPrecision(param_dtype=torch.float16),
                 cpu_offload=tfsdp.CPUOffload(offload_params=True),
                 backward_prefetch=tfsdp.BackwardPrefetch.BACKWARD_POST)
    unit = model.layers[0]._unit
    x, y = _batch(0)
    lm_loss(model(x), y).backward()
    with FSDP.state_dict_type(model, tfsdp.StateDictType.FULL_STATE_DICT,
                              tfsdp.FullStateDictConfig(offload_to_cpu=True, rank0_only=True)):
        sd = model.state_dict()
    return {"zero2": not unit.reshard_after_forward,
            "fp16": unit.mp_policy.param_dtype == torch.float16,
            "offload": unit.group.offload is not None,
            "post": unit.backward_prefetch_after_grads,
            "rank0_only": (len(sd) > 0) == (dist.get_rank() == 0)}


def test_torch_option_types_are_accepted():
    """Code that changed only the FSDP import still passes torch's enums and configs."""
    for out in run_distributed(_torch_option_types, 2):
        assert all(out.values()), out


def _older_optimizer_state_dict_methods():
    model, opt = _trained()
    full = FSDP.full_optim_state_dict(model, opt)  # rank0_only=True, as torch
    sharded = FSDP.sharded_optim_state_dict(model, opt)
    key = "layers.0.mlp.fc.weight"
    state = sharded["state"][key]["exp_avg"]
    out = {"rank0_full": (len(full) > 0) == (dist.get_rank() == 0),
           "sharded": isinstance(state, DTensor)}
    if dist.get_rank() == 0:
        out["same"] = torch.equal(full["state"][key]["exp_avg"], state.full_tensor())
    else:
        state.full_tensor()  # the collective rank 0 runs above
    for method, args in (("shard_full_optim_state_dict", (full, model)),
                         ("scatter_full_optim_state_dict", (full, model)),
                         ("rekey_optim_state_dict", (full, None, model))):
        with pytest.raises(NotImplementedError, match="optim_state_dict"):
            getattr(FSDP, method)(*args)
    with pytest.raises(NotImplementedError, match="reduce_dtype"):
        model.register_comm_hook(None, None)
    return out


def test_older_optimizer_state_dict_methods():
    for out in run_distributed(_older_optimizer_state_dict_methods, 2):
        assert all(out.values()), out


def _hybrid_from_process_group_pair():
    from fullshard.testing.parity import check_parity

    rank = dist.get_rank()
    intra = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
    inter = [dist.new_group([0, 2]), dist.new_group([1, 3])][rank % 2]
    report = check_parity(lambda: GPT(CFG), lambda m: FSDP(
        m, auto_wrap_policy=POLICY, sharding_strategy=ShardingStrategy.HYBRID_SHARD,
        process_group=(intra, inter)), lambda s: _batch(s, 8),
        lambda model, b: lm_loss(model(b[0]), b[1]), steps=3)
    model = FSDP(GPT(CFG), auto_wrap_policy=POLICY, process_group=(intra, inter),
                 sharding_strategy=ShardingStrategy.HYBRID_SHARD)
    w = model.layers[0].mlp.fc.weight
    return {"placements": [type(p).__name__ for p in w.placements],
            "halves": w.to_local().shape[0] == w.shape[0] // 2,
            "parity": report.max_weight_diff < 1e-5}


@pytest.mark.slow
def test_hybrid_shard_from_an_intra_inter_process_group_pair():
    for out in run_distributed(_hybrid_from_process_group_pair, 4):
        assert out["placements"] == ["Replicate", "Shard"] and out["halves"] and out["parity"]
