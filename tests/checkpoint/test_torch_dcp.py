"""Checkpoints torch's DCP wrote load into fullshard models (unverified, with a warning),
and train on as the model that saved them would; fullshard's load with torch alone."""

import pytest
import os
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict

from fullshard import checkpoint as ckpt
from fullshard.gpt import GPT
from fullshard.testing import run_distributed

from support.checkpoint_runs import CFG, full_state, sharded_gpt, train_and_save, train_step


def _train_save_and_continue(path, shard_with_torch, layout):
    """Two steps, a save by torch's DCP alone, two more steps: the losses and weights
    a resumed model must reproduce."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    torch.manual_seed(0)
    model = GPT(CFG)
    if shard_with_torch:
        for layer in model.layers:
            torch_fully_shard(layer)
        torch_fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(2):
        train_step(model, opt, step)
    model_state, optim_state = get_state_dict(model, opt)
    state = {"model": model_state, "optim": optim_state}
    if layout == "app":  # torch's recipe wraps both in one object
        state = {"app": state}
    dcp.save(state, checkpoint_id=path)
    return [train_step(model, opt, step) for step in range(2, 4)], full_state(model)


def _resume_unverified(path):
    model = sharded_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        extra = ckpt.load(path, model, opt)
    assert extra is None
    assert any(issubclass(w.category, ckpt.UnverifiedCheckpointWarning) for w in caught)
    return [train_step(model, opt, step) for step in range(2, 4)], full_state(model)


def _assert_trains_on_alike(source, resumed):
    (source_losses, source_weights), (losses, weights) = source, resumed
    torch.testing.assert_close(losses, source_losses, rtol=1e-5, atol=1e-6)
    assert weights.keys() == source_weights.keys()
    for k in weights:
        torch.testing.assert_close(weights[k], source_weights[k], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_a_torch_fsdp2_checkpoint_resumes_in_fullshard_as_in_torch(tmp_path):
    path = str(tmp_path / "torch_fsdp2")
    source = run_distributed(_train_save_and_continue, 2, path, True, "model")[0]
    _assert_trains_on_alike(source, run_distributed(_resume_unverified, 2, path)[0])


@pytest.mark.slow
def test_a_plain_module_checkpoint_resumes_in_fullshard_as_in_one_process(tmp_path):
    path = str(tmp_path / "plain")
    source = run_distributed(_train_save_and_continue, 1, path, False, "app")[0]
    _assert_trains_on_alike(source, run_distributed(_resume_unverified, 1, path)[0])


def _load_model_alone(path):
    model = sharded_gpt()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ckpt.UnverifiedCheckpointWarning)
        ckpt.load(path, model)
    return full_state(model)


@pytest.mark.slow
def test_a_bare_state_dict_saved_by_torch_loads_at_another_world_size(tmp_path):
    torch.manual_seed(3)
    source = GPT(CFG)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "assuming ... a single process"
        dcp.save(source.state_dict(), checkpoint_id=str(tmp_path / "bare"), no_dist=True)
    loaded = run_distributed(_load_model_alone, 2, str(tmp_path / "bare"))[0]
    for k, v in source.state_dict().items():
        assert torch.equal(loaded[k], v), k


@pytest.mark.slow
def test_torch_dcp_alone_loads_a_fullshard_checkpoint_into_a_plain_module(tmp_path):
    _, saved = run_distributed(train_and_save, 2, str(tmp_path), 2, 2)[0]
    model = GPT(CFG)
    state = {"model": model.state_dict()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=os.path.join(tmp_path, "step_2"), no_dist=True)
    model.load_state_dict(state["model"])
    for k, v in model.state_dict().items():
        assert torch.equal(saved[k], v), k
