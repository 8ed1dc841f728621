"""Quantized communication (ZeRO++'s qwZ and qgZ): int8 blocks with fp32 scales on the
wire, gradients summed in fp32 (Note [quantized communication])."""

import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import fullshard.checkpoint as fcp
from fullshard import MixedPrecisionPolicy, fully_shard
from fullshard.core.features.quantized_collectives import dequantize, quantize, wire_bytes
from fullshard.gpt import GPT, GPTConfig, lm_loss
from fullshard.testing import run_distributed
from fullshard.testing.counting import count_sent_bytes
from fullshard.testing.models import token_batch

CFG = GPTConfig(vocab_size=64, seq_len=12, d_model=64, n_layers=2, n_heads=2)


def test_blockwise_int8_round_trip_is_within_half_a_step_per_block():
    torch.manual_seed(0)
    x = torch.randn(3, 1000) * torch.logspace(-3, 3, 1000)  # magnitudes spanning 6 decades
    x[1, 256:512] = 0.0  # an all-zero block
    block = 256
    packed = torch.empty(3, wire_bytes(1000, block), dtype=torch.uint8)
    quantize(x, block, packed)
    back = dequantize(packed, 1000, block)
    padded = torch.nn.functional.pad(x, (0, 24)).view(3, 4, block)
    step = padded.abs().amax(dim=2, keepdim=True) / 127  # one rounding step per block
    err = (torch.nn.functional.pad(back - x, (0, 24)).view(3, 4, block)).abs()
    assert (err <= step / 2 + 1e-6 * step).all()
    assert (back[1, 256:512] == 0).all()
    assert wire_bytes(1000, block) == 4 * 256 + 4 * 4  # int8 blocks, then fp32 scales


def _build(weights, grads, mp=None):
    torch.manual_seed(0)
    model = GPT(CFG)
    kwargs = {"mp_policy": mp} if mp is not None else {}
    for layer in model.layers:
        fully_shard(layer, **kwargs)
    if mp is not None:  # logits (and the loss compared) in fp32
        kwargs = {"mp_policy": dataclasses.replace(mp, output_dtype=torch.float32)}
    fully_shard(model, **kwargs)
    model.set_quantized_communication(weights=weights, grads=grads)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _train(model, opt, steps, first=0):
    rank, world = dist.get_rank(), dist.get_world_size()
    n = 8 // world
    losses = []
    for step in range(first, first + steps):
        x, y = token_batch(step, 8, CFG.vocab_size, CFG.seq_len)
        loss = lm_loss(model(x[rank * n:(rank + 1) * n]), y[rank * n:(rank + 1) * n])
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    return losses


def _bytes_and_losses(dtype_name):
    mp = None if dtype_name == "fp32" else MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    out = {}
    for name, (w, g) in {"plain": (False, False), "weights": (True, False),
                         "grads": (False, True), "both": (True, True)}.items():
        model, opt = _build(w, g, mp)
        _train(model, opt, 1)  # the first step builds buffers; count the second
        with count_sent_bytes() as counts:
            losses = _train(model, opt, 1, first=1)
        losses += _train(model, opt, 8, first=2)
        out[name] = {"bytes": dict(counts), "losses": losses}
    return out


@pytest.mark.parametrize("dtype_name, ratio", [("bf16", 0.5), ("fp32", 0.25)])
@pytest.mark.slow
def test_quantized_collectives_send_a_byte_per_element_and_train_alike(dtype_name, ratio):
    out = run_distributed(_bytes_and_losses, 2, dtype_name)[0]
    plain = out["plain"]["bytes"]
    for name, gathers, reduces in (("weights", True, False), ("grads", False, True),
                                   ("both", True, True)):
        sent = out[name]["bytes"]
        # int8 + one fp32 scale per 256 elements (+ the fp32 presence flags): just over
        # a byte per element, against 2 for bf16 and 4 for fp32
        for key, quantized in (("all_gather", gathers), ("reduce_scatter", reduces)):
            r = sent[key] / plain[key]
            assert (ratio < r < ratio * 1.1) if quantized else r == 1.0, (name, key, r)
        # the loss curve stays within 1% of full precision's at every step
        for a, b in zip(out[name]["losses"], out["plain"]["losses"]):
            assert a == pytest.approx(b, rel=1e-2), (name, out[name]["losses"])


def _resume(ckpt):
    straight = _build(True, True)
    losses = _train(*straight, 6)
    first = _build(True, True)
    _train(*first, 3)
    fcp.save(ckpt, *first)
    resumed = _build(True, True)
    fcp.load(ckpt, *resumed)
    after = _train(*resumed, 3, first=3)
    diff = max((a.to_local() - b.to_local()).abs().max().item()
               for a, b in zip(straight[0].parameters(), resumed[0].parameters()))
    # the shards and the checkpoint are exact: the quantized run resumes bit for bit
    return diff, losses[3:], after


@pytest.mark.slow
def test_quantized_communication_resumes_exactly(tmp_path):
    for diff, straight, resumed in run_distributed(_resume, 2, str(tmp_path / "ckpt")):
        assert diff == 0.0 and straight == resumed


class _AllGather:
    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group,
                                           async_op=async_op)


def _misuse():
    errors = {}

    def catch(key, fn):
        try:
            fn()
        except (ValueError, TypeError) as e:
            errors[key] = str(e)

    model = fully_shard(nn.Linear(4, 4))
    catch("bool", lambda: model.set_quantized_communication(weights=1))
    catch("block", lambda: model.set_quantized_communication(weights=True, block_size=100))
    custom = fully_shard(nn.Linear(4, 4))
    custom.set_custom_all_gather(_AllGather())
    catch("custom", lambda: custom.set_quantized_communication(weights=True))
    from torch.distributed.device_mesh import init_device_mesh
    replicated = fully_shard(nn.Linear(4, 4), mesh=init_device_mesh(
        "cpu", (dist.get_world_size(), 1), mesh_dim_names=("replicate", "shard")))
    catch("no_shard", lambda: replicated.set_quantized_communication(grads=True))
    merged = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    fully_shard(merged[0])
    fully_shard(merged[1])
    fully_shard(merged)
    merged(torch.randn(2, 4)).sum().backward()  # the first forward merges the small units
    catch("merged", lambda: merged[0].set_quantized_communication(grads=True))
    return errors


def test_quantized_communication_misuse_names_the_conflict():
    errors = run_distributed(_misuse, 2)[0]
    assert "set_quantized_communication expects a bool" in errors["bool"] or \
        "bool" in errors["bool"], errors["bool"]
    assert "block_size must be a positive multiple of 32" in errors["block"]
    assert "weights=True and set_custom_all_gather both replace" in errors["custom"]
    assert "the unit is not sharded (NO_SHARD" in errors["no_shard"]
    assert "merged with" in errors["merged"]
