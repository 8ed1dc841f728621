"""CPUOffloadPolicy(params_on_device=True) beside the other features that change when a
unit gathers or when its shard is written: activation checkpointing (gathers again in
backward), parameters kept from forward to backward, parameters kept gathered across the
optimizer step, a whole-matrix optimizer (Muon writes each shard from an exchange),
optimizer states on disk, and the one-step delayed update (gathers read the copy taken
before the step). Each trains to the same bits as the same run copying from the host at
every gather (Note [parameters kept on the device] in core/storage.py)."""

import os

import pytest
import torch
import torch.distributed as dist

from fullshard import (CPUOffloadPolicy, DiskOffloadPolicy, MixedPrecisionPolicy,
                       OverlappedStep, apply_activation_checkpointing, fully_shard)
from fullshard.gpt import GPT, Block, GPTConfig
from fullshard.testing import run_distributed
from support.host_steps import assert_same_bits, train_and_read

CFG = GPTConfig(vocab_size=40, seq_len=10, d_model=16, n_layers=3, n_heads=2)
BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _policy(beside: str, on_device: bool, disk: str):
    if beside == "states on disk":
        os.makedirs(disk)
        return DiskOffloadPolicy(path=disk, params_on_device=on_device)
    return CPUOffloadPolicy(pin_memory=False, params_on_device=on_device)


def _train(beside: str, on_device: bool, disk: str):
    torch.manual_seed(0)
    model = GPT(CFG)
    if beside == "checkpointed":
        apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Block))
    policy = _policy(beside, on_device, os.path.join(disk, "on" if on_device else "off"))
    kept = {"reshard_after_forward": False} if beside == "kept to backward" else {}
    for layer in model.layers:
        fully_shard(layer, offload_policy=policy, mp_policy=BF16, **kept)
    fully_shard(model, offload_policy=policy, mp_policy=BF16)
    model.set_bucket_numel(0)
    if beside == "kept across steps":
        model.set_reshard_after_backward(False, recurse=True)
    if beside == "muon":
        matrices = [p for layer in model.layers for p in layer.parameters() if p.ndim == 2]
        opt = torch.optim.Muon(matrices, lr=0.02, weight_decay=0.1)
        return train_and_read(model, opt, opt, "plain", CFG.vocab_size, CFG.seq_len)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, fused=True)
    stepper = OverlappedStep(opt, delayed=True, delay_after=1) if beside == "delayed" else opt
    out = train_and_read(model, opt, stepper, "fused", CFG.vocab_size, CFG.seq_len)
    if beside == "delayed":
        stepper.wait()
    return out


def _same_bits(beside: str, disk: str):
    disk = os.path.join(disk, f"rank{dist.get_rank()}")
    assert_same_bits(_train(beside, False, disk), _train(beside, True, disk))
    return True


SLOW = pytest.mark.slow
BESIDE = ["kept across steps",  # the gathered parameters' staleness and the copy's, both
          pytest.param("checkpointed", marks=SLOW), pytest.param("kept to backward", marks=SLOW),
          pytest.param("states on disk", marks=SLOW), pytest.param("delayed", marks=SLOW),
          pytest.param("muon", marks=[SLOW, pytest.mark.skipif(
              not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon")])]


@pytest.mark.parametrize("beside", BESIDE)
def test_params_on_device_beside_another_feature_trains_to_the_same_bits(beside, tmp_path):
    assert all(run_distributed(_same_bits, 2, beside, str(tmp_path)))
