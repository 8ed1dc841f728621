"""What torch's FSDP2 memory test bounds, counted on CPU/gloo in units and elements.

torch measures CUDA peak bytes per phase and bounds them by counts of blocks: in forward
and backward with ``reshard_after_forward=True`` (with and without CPU offload) at most
the current block and the next one are gathered beside the root's parameters; with
``False`` every unit is gathered at the end of forward; the optimizer step holds sharded
parameters, sharded gradients and two sharded Adam states; ``zero_grad`` frees the
gradients. Bytes on CPU are the allocator's, so here the same bounds are read off
fullshard's groups (how many units are gathered at each module's forward and backward)
and off the tensors' sizes. One two-rank launch.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from fullshard import CPUOffloadPolicy, fully_shard
from fullshard.core.group import GroupState
from fullshard.gpt import GPT, GPTConfig, lm_loss
from fullshard.testing import run_distributed
from fullshard.testing.models import token_batch

CFG = GPTConfig(vocab_size=32, seq_len=4, d_model=32, n_layers=3, n_heads=2)
_GATHERED = (GroupState.UNSHARDED, GroupState.GATHERING, GroupState.KEPT)


def _blocks_gathered(model: GPT) -> int:
    return sum(1 for layer in model.layers if layer._fullshard_unit.group.state in _GATHERED)


def _case(reshard: bool, offload: bool) -> dict:
    torch.manual_seed(42)
    model = GPT(CFG)
    policy = {"offload_policy": CPUOffloadPolicy()} if offload else {}
    for layer in model.layers:
        fully_shard(layer, reshard_after_forward=reshard, **policy)
    fully_shard(model, reshard_after_forward=reshard, **policy)
    model.set_bucket_numel(0)  # one unit per block, as torch's accounting counts them
    optim = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=False)
    peaks = {"forward": 0, "backward": 0}
    phase = ["forward"]

    def sample(*_):
        peaks[phase[0]] = max(peaks[phase[0]], _blocks_gathered(model))
    for module in model.modules():
        if not list(module.children()):  # leaves: the moments compute reads parameters
            module.register_forward_pre_hook(sample)
            module.register_full_backward_pre_hook(sample)
    ids, targets = token_batch(0, 1, CFG.vocab_size, CFG.seq_len)
    loss = lm_loss(model(ids), targets)
    end_of_forward = _blocks_gathered(model)
    phase[0] = "backward"
    loss.backward()
    after_backward = _blocks_gathered(model)
    optim.step()
    shard_sizes = [p.to_local().numel() for p in model.parameters()]
    grads_sharded = [p.grad.to_local().numel() for p in model.parameters()] == shard_sizes
    states_sharded = all(
        [optim.state[p][k].to_local().numel() for k in ("exp_avg", "exp_avg_sq")] == [n, n]
        for p, n in zip(model.parameters(), shard_sizes))
    optim.zero_grad()
    return {"peaks": peaks, "end_of_forward": end_of_forward, "after_backward": after_backward,
            "grads_sharded": grads_sharded, "states_sharded": states_sharded,
            "grads_freed": all(p.grad is None for p in model.parameters()),
            "on_cpu": all(p.to_local().device.type == "cpu" for p in model.parameters())}


def _all_cases() -> dict:
    return {(reshard, offload): _case(reshard, offload)
            for reshard, offload in ((True, False), (True, True), (False, False))}


@pytest.mark.slow
def test_gathered_units_and_sharded_state_stay_within_torchs_bounds():
    for (reshard, offload), seen in run_distributed(_all_cases, 2)[0].items():
        what = f"reshard {reshard}, offload {offload}: {seen}"
        if reshard:  # the current block and the one prefetched, never more
            assert 1 <= seen["peaks"]["forward"] <= 2 and 1 <= seen["peaks"]["backward"] <= 2, what
            assert seen["end_of_forward"] == 0, what
        else:  # every block stays gathered from forward into backward
            assert seen["end_of_forward"] == CFG.n_layers, what
        assert seen["after_backward"] == 0, what
        assert seen["grads_sharded"] and seen["states_sharded"] and seen["grads_freed"], what
        assert seen["on_cpu"], what
