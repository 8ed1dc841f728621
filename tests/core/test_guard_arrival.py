"""Collective functions that check that every rank called them (core/guard/arrival.py, Note
[every rank arrives]): called on one rank, they fail on both in seconds, naming the call;
ranks at different calls name each other's; the wait is a positive number of seconds."""

import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout

from fullshard import fully_shard
from fullshard.core.guard import arrival
from fullshard.gpt import GPT, GPTConfig, lm_loss
from fullshard.testing import run_distributed
from fullshard.testing.models import token_batch
from support.catalogue import matches_documented
from support.rank_failures import first_error

CFG = GPTConfig(vocab_size=40, seq_len=8, d_model=16, n_layers=3, n_heads=2)


def _trained_model():
    os.environ["FULLSHARD_ARRIVAL_TIMEOUT"] = "3"
    os.environ["FULLSHARD_DEBUG_TIMEOUT"] = "20"  # how long the guard waits (rank 1, below)
    torch.manual_seed(0)
    model = GPT(CFG)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    model.set_bucket_numel(0)  # one collective per layer: rank 1 waits in the root's gather
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = token_batch(0, 2, CFG.vocab_size, CFG.seq_len)
    lm_loss(model(x), y).backward()
    opt.step()
    return model, opt, x, y


def _save_on_rank0_only(path):
    from fullshard import checkpoint

    model, opt, x, y = _trained_model()
    if dist.get_rank() == 0:
        checkpoint.save(path, model, opt)
    else:  # goes on training: its next all-gather waits for a rank that is saving
        lm_loss(model(x), y).backward()


def _full_state_dict_on_rank0_only(_path):
    from fullshard.checkpoint import StateDictOptions, get_model_state_dict

    model, _opt, x, y = _trained_model()
    if dist.get_rank() == 0:
        get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    else:
        lm_loss(model(x), y).backward()


def _save_here_load_there(path):
    from fullshard import checkpoint

    model, opt, _x, _y = _trained_model()
    if dist.get_rank() == 0:
        checkpoint.save(path, model, opt)
    else:
        checkpoint.load(path, model, opt)


@pytest.mark.slow
@pytest.mark.parametrize("scenario,call", [
    (_save_on_rank0_only, "fullshard.checkpoint.save"),
    (_full_state_dict_on_rank0_only, "get_model_state_dict (full_state_dict=True"),
], ids=["save", "full_state_dict"])
def test_a_collective_function_called_on_one_rank_fails_on_both_in_seconds(
        scenario, call, tmp_path):
    import time

    started = time.monotonic()
    with pytest.raises(AssertionError) as failure:
        run_distributed(scenario, 2, str(tmp_path / "ckpt"), timeout=120)
    text = str(failure.value)
    assert time.monotonic() - started < 60, text[-3000:]  # not the group's 30 minutes
    assert "2 of 2 ranks failed" in text, text[-3000:]
    raised = first_error(text[text.index(f"CollectiveError: fullshard: {call}"):],
                         "CollectiveError")  # rank 0's

    assert "Ranks 1 failed to pass monitoredBarrier in 3000 ms" in raised, raised
    assert matches_documented("E130", raised), raised
    # rank 1, stalled in a training all-gather, names it when rank 0 does not come to compare
    assert ("DivergenceError: fullshard: rank 1 waited in the all-gather of GPT (step 1), then "
            "waited for the other ranks") in text, text[-3000:]
    assert matches_documented("E150", first_error(text, "DivergenceError")), text[-3000:]


def test_ranks_at_different_collective_functions_both_name_them(tmp_path):
    text = str(pytest.raises(AssertionError, run_distributed, _save_here_load_there, 2,
                             str(tmp_path / "ckpt"), timeout=120).value)
    assert "2 of 2 ranks failed" in text, text[-3000:]
    assert text.count("rank 0: fullshard.checkpoint.save (check-in 1), rank 1: "
                      "fullshard.checkpoint.load (check-in 1)") == 2, text[-3000:]
    assert matches_documented("E131", first_error(text, "CollectiveError")), text[-3000:]


@pytest.mark.parametrize("value", ["0", "-3", "soon", "inf"])
def test_the_wait_must_be_a_positive_number_of_seconds(value, monkeypatch):
    monkeypatch.setenv(arrival.TIMEOUT_VARIABLE, value)
    with pytest.raises(ValueError, match=rf"FULLSHARD_ARRIVAL_TIMEOUT='{value}': expected a "
                                         "positive number of seconds"):
        arrival.timeout_s()
    monkeypatch.setenv(arrival.TIMEOUT_VARIABLE, "2.5")
    assert arrival.timeout_s() == 2.5
    monkeypatch.delenv(arrival.TIMEOUT_VARIABLE)  # unset: torch's own default
    assert arrival.timeout_s() == default_pg_timeout.total_seconds()
