"""A GPT built on the meta device and sharded per block with the trainer's per-unit
offload policies, and the host storages its tensors hold: what the memory tests that
compare an estimate's bytes with a run's share."""

from __future__ import annotations

import dataclasses

import torch

from fullshard import fully_shard
from fullshard.gpt import GPT, GPTConfig


def gpt_offloaded_as_the_trainer_does(cfg: GPTConfig, offload: str) -> GPT:
    """``cfg``'s GPT, each block and the root sharded with the policy the trainer gives
    them for ``--parallel.offload offload``, materialized on the CPU and initialized."""
    from fullshard.train.config.schema import get_preset
    from fullshard.train.model import unit_offload

    with torch.device("meta"):
        model = GPT(cfg)
    policy_of = unit_offload(model, dataclasses.replace(get_preset("debug").parallel,
                                                        offload=offload))
    for layer in model.layers:
        fully_shard(layer, offload_policy=policy_of(layer))
    fully_shard(model, offload_policy=policy_of(model))
    model.to_empty(device="cpu")
    model.init_weights()
    return model


def storages_of(tensors) -> dict[int, int]:
    """The distinct storages under ``tensors`` (DTensors: their local pieces): bytes by
    address."""
    found = {}
    for t in tensors:
        s = (t.to_local() if hasattr(t, "to_local") else t).untyped_storage()
        found[s.data_ptr()] = s.nbytes()
    return found
