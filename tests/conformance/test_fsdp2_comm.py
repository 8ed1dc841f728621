"""The public-API behaviours of torch's FSDP2 communication tests, run on CPU/gloo.

How many all-gathers and reduce-scatters a forward and a backward issue for each
``reshard_after_forward`` (True, False, an integer, None), set at ``fully_shard`` or
changed afterwards with ``set_reshard_after_forward`` (recursing or on the root
alone); a manual ``reshard()`` of units built not to reshard makes backward gather
them again; ``set_reduce_scatter_max_input_buffers`` refuses what torch refuses and
trains the same losses as the default. Counted with one unit per all-gather
(``set_bucket_numel(0)``): fullshard's default merges small units into one all-gather
(docs/conformance.md). All cases run in one two-rank launch.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from fullshard import FSDPModule, fully_shard
from fullshard.gpt import GPT, GPTConfig, lm_loss
from fullshard.testing import run_distributed
from fullshard.testing.counting import count_forward_backward
from fullshard.testing.models import token_batch

CFG = GPTConfig(vocab_size=40, seq_len=8, d_model=16, n_layers=3, n_heads=2)
BLOCKS = CFG.n_layers


def _sharded(*, bucket_numel: int = 0, **kwargs) -> GPT:
    torch.manual_seed(42)
    model = GPT(CFG)
    for layer in model.layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    if bucket_numel is not None:
        model.set_bucket_numel(bucket_numel)  # 0: one all-gather per unit, as torch
    return model


def _tidy(counts: dict) -> dict:
    """All-gathers of either kind (prefetches are asynchronous) counted together."""
    gathers = counts.get("all_gather", 0) + counts.get("all_gather_async", 0)
    return {"all_gather": gathers, "reduce_scatter": counts.get("reduce_scatter", 0),
            "all_reduce": counts.get("all_reduce", 0)}


def _counts(model: GPT) -> tuple[dict, dict]:
    """(forward, backward) counts of one step."""
    ids, targets = token_batch(0, 2, CFG.vocab_size, CFG.seq_len)
    fwd, bwd = count_forward_backward(lambda: lm_loss(model(ids), targets))
    return _tidy(fwd), _tidy(bwd)


def _expected_backward_gathers(setting) -> int:
    """torch: None keeps the root whole (blocks only), True or an integer regathers
    every unit, False none."""
    return {None: BLOCKS, False: 0}.get(setting, BLOCKS + 1)


def _per_setting() -> dict:
    seen = {}
    for setting in (True, False, 2, None):
        fwd, bwd = _counts(_sharded(reshard_after_forward=setting))
        seen[repr(setting)] = (fwd, bwd)
    return seen


def _manual_reshard() -> tuple[dict, dict]:
    model = _sharded(reshard_after_forward=False)
    ids, targets = token_batch(0, 2, CFG.vocab_size, CFG.seq_len)
    loss = lm_loss(model(ids), targets)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
    _, bwd = count_forward_backward(lambda: loss)
    return _tidy(bwd)


def _set_after_construction() -> dict:
    seen = {}
    for setting in (True, False):
        for recurse in (True, False):
            model = _sharded(reshard_after_forward=not setting)
            model.set_reshard_after_forward(setting, recurse=recurse)
            seen[(setting, recurse)] = _counts(model)[1]["all_gather"]
    return seen


def _max_input_buffers() -> tuple[list[str], list[float], list[float]]:
    refused = []
    model = fully_shard(nn.Linear(16, 16))
    for bad in (0, 2.5, True):
        try:
            model.set_reduce_scatter_max_input_buffers(bad)
        except (ValueError, TypeError) as err:
            refused.append(type(err).__name__)
    model.set_reduce_scatter_max_input_buffers(2)
    losses = []
    for buffers in (None, 2):
        model = _sharded()
        if buffers is not None:
            model.set_reduce_scatter_max_input_buffers(buffers)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
        run = []
        for step in range(3):
            ids, targets = token_batch(step, 2, CFG.vocab_size, CFG.seq_len)
            loss = lm_loss(model(ids), targets)
            loss.backward()
            optim.step()
            optim.zero_grad()
            run.append(loss.item())
        losses.append(run)
    return refused, losses[0], losses[1]


def _default_buckets() -> dict:
    return {repr(s): _counts(_sharded(bucket_numel=None, reshard_after_forward=s))
            for s in (True, None)}


def _all_cases() -> dict:
    return {"default": _default_buckets(), "per_setting": _per_setting(), "manual": _manual_reshard(),
            "set": _set_after_construction(), "buffers": _max_input_buffers()}


@pytest.fixture(scope="module")
def seen() -> dict:
    return run_distributed(_all_cases, 2, timeout=300)[0]


@pytest.mark.slow
@pytest.mark.parametrize("setting", [True, False, 2, None])
def test_collective_counts_follow_reshard_after_forward(seen, setting):
    fwd, bwd = seen["per_setting"][repr(setting)]
    assert fwd == {"all_gather": BLOCKS + 1, "reduce_scatter": 0, "all_reduce": 0}, fwd
    assert bwd == {"all_gather": _expected_backward_gathers(setting),
                   "reduce_scatter": BLOCKS + 1, "all_reduce": 0}, bwd


@pytest.mark.slow
def test_a_manual_reshard_makes_backward_gather_again(seen):
    assert seen["manual"] == {"all_gather": BLOCKS + 1, "reduce_scatter": BLOCKS + 1,
                              "all_reduce": 0}, seen["manual"]


@pytest.mark.slow
def test_set_reshard_after_forward_counts_as_at_construction(seen):
    # recurse=False changes the root alone: the blocks keep what fully_shard gave them
    assert seen["set"] == {(True, True): BLOCKS + 1, (True, False): 1,
                           (False, True): 0, (False, False): BLOCKS}, seen["set"]


@pytest.mark.slow
def test_reduce_scatter_max_input_buffers_refusals_and_parity(seen):
    refused, default, two = seen["buffers"]
    assert refused == ["ValueError", "TypeError", "TypeError"], refused
    assert default == two, (default, two)


@pytest.mark.slow
def test_default_bucketing_merges_these_small_units_into_fewer_collectives(seen):
    """The deliberate difference (docs/conformance.md): left to fullshard's default
    bucket size, this model's four small units are gathered and reduced as one: one
    all-gather in forward, one reduce-scatter in backward, and under the default
    reshard_after_forward=None no all-gather in backward (the merged group is the
    root's, which None keeps whole), where torch regathers each block."""
    one = {"all_gather": 1, "reduce_scatter": 0, "all_reduce": 0}
    assert seen["default"]["True"] == (one, {**one, "reduce_scatter": 1}), seen["default"]
    assert seen["default"]["None"] == (one, {**one, "all_gather": 0, "reduce_scatter": 1})
