"""The estimate with ``params_on_device=True`` (CPUOffloadPolicy(params_on_device=True),
Note [parameters kept on the device]): the copies of the offloaded shards kept on the
device, against a run's, byte for byte; and its refusals."""

import re

import pytest
import torch

from fullshard import fully_shard
from fullshard.cli.memory import estimate_main
from fullshard.errors import ConfigError
from fullshard.gpt import GPT, GPTConfig, lm_loss
from fullshard.memory import estimate
from fullshard.testing import run_distributed
from support.offloaded_gpt import storages_of

BATCH, SEQ = 1, 64


def _storage_bytes(tensors) -> int:
    return sum(storages_of(tensors).values())


def device_copies_of_a_fraction(cfg: GPTConfig, offload: str) -> dict:
    """``cfg``'s GPT with the trainer's per-unit policies for ``--parallel.offload offload
    --parallel.params_on_device true``, gathered in bf16, after 2 AdamW steps: the bytes of
    the copies the offloaded units keep on the device, and of their host shards."""
    import dataclasses

    import torch.distributed as dist

    from fullshard import MixedPrecisionPolicy
    from fullshard.train.config.schema import get_preset
    from fullshard.train.model import unit_offload

    with torch.device("meta"):
        model = GPT(cfg)
    policy_of = unit_offload(model, dataclasses.replace(
        get_preset("debug").parallel, offload=offload, params_on_device=True))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.layers:
        fully_shard(layer, offload_policy=policy_of(layer), mp_policy=mp)
    fully_shard(model, offload_policy=policy_of(model), mp_policy=mp)
    model.to_empty(device="cpu")
    model.init_weights()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(2):
        tokens = torch.randint(0, cfg.vocab_size, (BATCH, SEQ), generator=gen)
        lm_loss(model(tokens).float(), torch.roll(tokens, -1, 1)).backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
    groups = [unit._unit.group for unit in (model, *model.layers)]
    offloaded = [g for g in groups if g.offload is not None]
    kept = [g for g in groups if g.offload is None]
    return {"device copies": _storage_bytes(g.storage.device_copy for g in offloaded),
            "kept on the device": sum(g.storage.device_copy is not None for g in kept),
            "offloaded units": len(offloaded)}


def test_the_copies_kept_on_the_device_are_the_estimates_bytes():
    """2 of 3 blocks offloaded with their parameters kept on the device as well, on 2
    ranks: the copies those blocks keep (bf16, the dtype they gather in) are what the
    estimate adds to the device's sharded parameters, byte for byte; the host holds what
    it holds without them."""
    cfg = GPTConfig(vocab_size=256, seq_len=SEQ, d_model=128, n_layers=3, n_heads=4)
    fraction = f"cpu:{2 / 3!r}"
    kwargs = dict(world_size=2, batch_size=BATCH, seq_len=SEQ, device="cpu",
                  process_baseline=0, offload=fraction, mp_policy=torch.bfloat16)
    on, off = (estimate(cfg, params_on_device=flag, **kwargs) for flag in (True, False))
    added = on.lines["sharded parameters"] - off.lines["sharded parameters"]
    assert added > 0 and on.host_bytes == off.host_bytes
    assert "parameters kept on the device" in on.table()
    for held in run_distributed(device_copies_of_a_fraction, 2, cfg, fraction):
        assert held["offloaded units"] == 2 and held["kept on the device"] == 0, held
        assert held["device copies"] == added, (held, added)


def test_on_a_gpu_every_offloaded_shard_has_its_copy_in_the_compute_dtype():
    """Computing on CUDA every gather of a host shard copies it in: the copies are the
    offloaded shards' elements in bf16, whatever the units' batching."""
    cfg = GPTConfig(vocab_size=256, seq_len=SEQ, d_model=128, n_layers=4, n_heads=4)
    kwargs = dict(world_size=4, batch_size=BATCH, seq_len=SEQ, device="cuda",
                  mp_policy=torch.bfloat16)
    none = estimate(cfg, **kwargs)
    on, off = (estimate(cfg, offload="cpu", params_on_device=flag, **kwargs)
               for flag in (True, False))
    fp32_shards = none.lines["sharded parameters"]  # every shard on the device, fp32
    added = on.lines["sharded parameters"] - off.lines["sharded parameters"]
    assert added == fp32_shards // 2
    assert on.host_bytes == off.host_bytes


@pytest.mark.parametrize("offload", ["none", "disk+params"])
def test_refused_where_no_offloaded_parameters_are_on_the_host(offload):
    cfg = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=2, n_heads=2)
    with pytest.raises(ValueError, match=f"params_on_device=True .* offload={re.escape(repr(offload))}"):
        estimate(cfg, world_size=2, offload=offload, params_on_device=True)
    with pytest.raises(ConfigError, match="--params-on-device: .* give --offload cpu or disk"):
        estimate_main(["--preset", "debug", "--world-size", "2", "--params-on-device",
                       *(["--offload", offload] if offload != "none" else [])])
