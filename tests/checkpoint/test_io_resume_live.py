"""Loading a checkpoint into the live model and optimizer, then training on.

Every case trains, saves, trains on (the uninterrupted reference), then loads the save
back into the same model and optimizer and repeats those steps: the losses, step by
step, and the final weights must equal the reference's. Each run goes through every
way of loading in turn, so every load after the first also lands on a model that has
already been loaded into (Note [one storage is the shard]).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map

from fullshard import (FSDP, CPUOffloadPolicy, MixedPrecisionPolicy, ShardingStrategy,
                       StateDictType, fully_shard)
from fullshard import checkpoint as ckpt
from fullshard import optim as fs_optim
from fullshard.testing import run_distributed
from fullshard.gpt import GPT, Block, GPTConfig, lm_loss
from fullshard.wrap import ModuleWrapPolicy

CFG = GPTConfig(vocab_size=40, seq_len=8, d_model=16, n_layers=3, n_heads=2)
STEPS_BEFORE, STEPS_AFTER = 2, 3
RTOL = 1e-5


# -- model, steps -----------------------------------------------------------------------
def _build(setting: str, world: int):
    torch.manual_seed(0)
    model = GPT(CFG)
    kwargs: dict = {}
    layer_kwargs: dict = {}
    if setting == "offload":
        kwargs["offload_policy"] = CPUOffloadPolicy()
    elif setting == "mixed_precision":
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                   reduce_dtype=torch.float32)
    elif setting == "reshard_after_forward_false":
        layer_kwargs["reshard_after_forward"] = False
    elif setting == "zero1":  # Note [ZeRO-1 is ZeRO-2 keeping the gathered storage]
        layer_kwargs["reshard_after_forward"] = False
    elif setting == "reshard_after_forward_2":
        layer_kwargs["reshard_after_forward"] = 2
    elif setting == "hybrid_shard":
        kwargs["mesh"] = init_device_mesh("cpu", (2, world // 2),
                                          mesh_dim_names=("replicate", "shard"))
    elif setting == "no_shard":
        kwargs["mesh"] = init_device_mesh("cpu", (world, 1),
                                          mesh_dim_names=("replicate", "shard"))
    for layer in model.layers:
        fully_shard(layer, **kwargs, **layer_kwargs)
    fully_shard(model, **kwargs)
    if setting == "unmerged":
        model.set_bucket_numel(0)
    if setting == "zero1":
        model.set_keep_unsharded_storage(True)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _batch(step: int, micro: int = 0):
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + dist.get_rank())
    x = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len), generator=g)
    return x, torch.roll(x, -1, 1)


def _step(model, opt, step: int, between_micro_batches=None) -> float:
    """One optimizer step over two micro-batches (gradient accumulation);
    ``between_micro_batches`` runs after the first backward."""
    total = 0.0
    for micro in range(2):
        x, y = _batch(step, micro)
        loss = lm_loss(model(x), y) / 2
        loss.backward()
        total += loss.item()
        if micro == 0 and between_micro_batches is not None:
            between_micro_batches()
    opt.step()
    opt.zero_grad()
    return total


def _full_weights(model) -> dict[str, torch.Tensor]:
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().float().clone()
            for k, v in ckpt.get_model_state_dict(model).items()}


def _clone(tree):
    return tree_map(lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t, tree)


def _assert_close(what: str, got: list[float], ref: list[float]) -> None:
    for i, (g, r) in enumerate(zip(got, ref, strict=True)):
        assert abs(g - r) <= RTOL * abs(r), f"{what}: step {STEPS_BEFORE + i}: {g} != {r}"


def _assert_same_weights(what: str, got: dict, ref: dict) -> None:
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=RTOL, atol=1e-6, msg=f"{what}: {k}")


# -- the ways of loading -------------------------------------------------------------------
class _Saved:
    """One save of the model and optimizer, in every form the loaders below read."""

    def __init__(self, model, opt, tmp: str):
        self.tmp = tmp
        self.dcp_dir = os.path.join(tmp, "dcp")
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=self.dcp_dir)
        self.fullshard_dir = ckpt.save(os.path.join(tmp, "fullshard", "step_2"), model, opt)
        self.model_sd = _clone(model.state_dict())
        self.optim_sd = _clone(opt.state_dict())


def _load_dcp(model, opt, saved):
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=saved.dcp_dir)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return opt


def _load_dcp_twice(model, opt, saved):
    return _load_dcp(model, _load_dcp(model, opt, saved), saved)


def _load_fullshard(model, opt, saved):
    ckpt.load(saved.fullshard_dir, model, opt)
    return opt


def _load_save_load(model, opt, saved):
    ckpt.load(saved.fullshard_dir, model, opt)
    again = ckpt.save(os.path.join(saved.tmp, "fullshard", "again"), model, opt)
    ckpt.load(again, model, opt)
    return opt


def _load_module(model, opt, saved):
    model.load_state_dict(_clone(saved.model_sd))
    opt.load_state_dict(_clone(saved.optim_sd))
    return opt


def _load_module_assign(model, opt, saved):
    model.load_state_dict(_clone(saved.model_sd), assign=True)
    # assign=True installs new parameter objects: the old optimizer must refuse to step
    with pytest.raises(RuntimeError, match="as it was before the module replaced it"):
        opt.step()
    fresh = torch.optim.AdamW(model.parameters(), lr=1e-2)
    fresh.load_state_dict(_clone(saved.optim_sd))
    return fresh


LOADERS = {"dcp": _load_dcp, "dcp_twice": _load_dcp_twice, "fullshard": _load_fullshard,
           "load_save_load": _load_save_load, "load_state_dict": _load_module,
           "load_state_dict_assign": _load_module_assign}


def _resume_live(setting: str, tmp: str, local_step: bool = True) -> None:
    fs_optim.set_local_step(local_step)
    tmp = os.path.join(tmp, "shared")
    world = dist.get_world_size()
    model, opt = _build(setting, world)
    for s in range(STEPS_BEFORE):
        _step(model, opt, s)
    saved = _Saved(model, opt, tmp)
    ref = [_step(model, opt, s) for s in range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER)]
    ref_weights = _full_weights(model)
    for name, load in LOADERS.items():
        opt = load(model, opt, saved)
        got = [_step(model, opt, s) for s in range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER)]
        _assert_close(f"{setting}/{name}", got, ref)
        _assert_same_weights(f"{setting}/{name}", _full_weights(model), ref_weights)
    # A load between the two micro-batches of a step (the saved state is the current one):
    # gradients accumulated so far are kept, as for a plain module.
    model, opt = _build(setting, world)
    straight = [_step(model, opt, s) for s in range(3)]
    model, opt = _build(setting, world)
    got = [_step(model, opt, 0)]
    path = ckpt.save(os.path.join(tmp, "mid", "step_1"), model, opt)
    got += [_step(model, opt, 1, between_micro_batches=lambda: ckpt.load(path, model, opt)),
            _step(model, opt, 2)]
    _assert_close(f"{setting}/between micro-batches", got, straight)


@pytest.mark.parametrize("setting,world", [
    ("merged", 1), ("merged", 2), ("merged", 4), ("unmerged", 2), ("offload", 2),
    ("mixed_precision", 2), ("reshard_after_forward_false", 2), ("zero1", 2),
    pytest.param("reshard_after_forward_2", 4, marks=pytest.mark.extended),
    pytest.param("hybrid_shard", 4, marks=pytest.mark.extended), ("no_shard", 2)])
@pytest.mark.slow
def test_load_into_the_live_model_trains_on_exactly(setting, world, tmp_path):
    run_distributed(_resume_live, world, setting, str(tmp_path))


@pytest.mark.slow
def test_load_into_the_live_model_without_the_local_step(tmp_path):
    run_distributed(_resume_live, 2, "merged", str(tmp_path), local_step=False)


# -- the FSDP1 front ------------------------------------------------------------------------
def _resume_live_fsdp1(state_dict_type: str, strategy: str) -> None:
    kind = StateDictType[state_dict_type]

    def build():
        torch.manual_seed(0)
        model = FSDP(GPT(CFG), auto_wrap_policy=ModuleWrapPolicy({Block}),
                     sharding_strategy=ShardingStrategy[strategy])
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    model, opt = build()
    for s in range(STEPS_BEFORE):
        _step(model, opt, s)
    with FSDP.state_dict_type(model, kind):
        model_sd = _clone(model.state_dict())
        optim_sd = _clone(FSDP.optim_state_dict(model, opt))
    ref = [_step(model, opt, s) for s in range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER)]
    ref_weights = _full_weights(model)
    for _ in range(2):  # twice: the second load lands on a model loaded into before
        with FSDP.state_dict_type(model, kind):
            model.load_state_dict(_clone(model_sd))
            opt.load_state_dict(FSDP.optim_state_dict_to_load(model, opt, _clone(optim_sd)))
        got = [_step(model, opt, s) for s in range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER)]
        _assert_close(f"FSDP1 {state_dict_type}", got, ref)
        _assert_same_weights(f"FSDP1 {state_dict_type}", _full_weights(model), ref_weights)


@pytest.mark.parametrize("state_dict_type", ["SHARDED_STATE_DICT", "FULL_STATE_DICT"])
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "NO_SHARD", "ZERO1"])
@pytest.mark.slow
def test_fsdp1_load_into_the_live_model_trains_on_exactly(state_dict_type, strategy):
    run_distributed(_resume_live_fsdp1, 2, state_dict_type, strategy)


# -- the guard and failed loads ---------------------------------------------------------------
def _guard_and_failed_loads(tmp: str) -> dict[str, str]:
    messages = {}
    model, opt = _build("merged", 2)
    _step(model, opt, 0)
    # A parameter's local tensor replaced behind fullshard's back: caught at the next step.
    p = model.layers[1].attn.qkv.weight
    p._local_tensor = p._local_tensor.clone()
    _, y = _batch(1)
    lm_loss(model(_batch(1)[0]), y).backward()
    with pytest.raises(RuntimeError) as err:
        opt.step()
    messages["local tensor replaced"] = str(err.value)

    # Loads that do not fit raise before anything changes, in the model or the optimizer.
    model, opt = _build("merged", 2)
    _step(model, opt, 0)
    weights, optim_state = _full_weights(model), _clone(opt.state_dict())
    bad = _clone(model.state_dict())
    bad["layers.2.mlp.proj.weight"] = torch.zeros(4, 3)
    for name, load in [("shape", lambda: model.load_state_dict(bad)),
                       ("missing", lambda: model.load_state_dict(
                           {k: v for k, v in bad.items() if k != "ln_f.weight"
                            and k != "layers.2.mlp.proj.weight"}))]:
        with pytest.raises(RuntimeError) as err:
            load()
        messages[name] = str(err.value)
    sgd_model, _ = _build("merged", 2)
    sgd = torch.optim.SGD(sgd_model.parameters(), lr=0.1)
    _step(sgd_model, sgd, 0)
    sgd_path = ckpt.save(os.path.join(tmp, "sgd", "step_1"), sgd_model, sgd)
    with pytest.raises(ckpt.CheckpointError) as err:
        ckpt.load(sgd_path, model, opt)
    messages["optimizer"] = str(err.value)
    _assert_same_weights("after failed loads", _full_weights(model), weights)
    for i, state in opt.state_dict()["state"].items():
        for k, v in state.items():
            assert torch.equal(_plain(v), _plain(optim_state["state"][i][k])), (i, k)
    # ... and the model still trains exactly like one that never saw the failed loads.
    ref_model, ref_opt = _build("merged", 2)
    _step(ref_model, ref_opt, 0)
    _assert_close("after failed loads", [_step(model, opt, 1)], [_step(ref_model, ref_opt, 1)])
    return messages


def _plain(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


@pytest.mark.slow
def test_guard_and_loads_that_do_not_fit(tmp_path):
    messages = run_distributed(_guard_and_failed_loads, 2, str(tmp_path))[0]
    assert "parameter 'layers.1.attn.qkv.weight'" in messages["local tensor replaced"]
    assert "no longer the shard its unit all-gathers" in messages["local tensor replaced"]
    assert "'layers.2.mlp.proj.weight' has shape (4, 3) in the state dict" in messages["shape"]
    assert "Nothing was loaded" in messages["shape"]
    assert "'ln_f.weight' is missing" in messages["missing"]
    assert "does not fit this optimizer" in messages["optimizer"]
    assert "optim.state.tok_emb.weight.exp_avg" in messages["optimizer"]


# -- _apply after training ------------------------------------------------------------------
def _apply_after_training() -> None:
    model, opt = _build("merged", 2)
    for s in range(STEPS_BEFORE):
        _step(model, opt, s)
    torch.manual_seed(0)
    ref = GPT(CFG)
    ref.load_state_dict(_full_weights(model))
    model.double()  # a new dtype: every group reallocates its flat shard, merged ones too
    ref.double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    rank = dist.get_rank()
    for s in range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER):
        g = torch.Generator().manual_seed(100 * s)
        x = torch.randint(0, CFG.vocab_size, (4, CFG.seq_len), generator=g)
        local = x[2 * rank:2 * rank + 2]
        loss = lm_loss(model(local), torch.roll(local, -1, 1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_loss = lm_loss(ref(x), torch.roll(x, -1, 1))
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        _assert_close("double()", [mean.item() / 2], [ref_loss.item()])
    _assert_same_weights("double()", _full_weights(model),
                         {k: v.detach().float() for k, v in ref.state_dict().items()})


@pytest.mark.slow
def test_apply_after_training_keeps_one_storage():
    run_distributed(_apply_after_training, 2)
