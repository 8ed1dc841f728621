"""Sharded gradients offloaded from CUDA are pinned as the offload policy says: pinned
by default (the copy from the device does not block), pageable with
``pin_memory=False``, as torch's FSDP2 copies them. Without CUDA nothing can be pinned, so
the allocation's request is what is checked."""

from types import SimpleNamespace

import pytest
import torch

from fullshard.core import gradients
from fullshard.policies import CPUOffloadPolicy


@pytest.mark.parametrize("pin_memory", [True, False])
def test_host_gradients_follow_the_policys_pin_memory(monkeypatch, pin_memory):
    asked = []

    def empty(*shape, pin_memory=False, **kw):
        asked.append(pin_memory)
        return torch.zeros(*shape, dtype=kw.get("dtype"))

    monkeypatch.setattr(gradients.torch, "empty", empty)
    reduction = object.__new__(gradients.GradReduction)
    reduction.group = SimpleNamespace(compute_device=torch.device("cuda"),
                                      offload=CPUOffloadPolicy(pin_memory=pin_memory))
    reduction._new_grad_buffer(8, torch.float32, torch.device("cpu"))
    reduction.group.compute_device = torch.device("cpu")  # computing on the host
    reduction._new_grad_buffer(8, torch.float32, torch.device("cpu"))
    assert asked == [pin_memory, False]
