"""torchtitan's own FSDP code, unchanged, on fullshard (``fullshard.install()``).

torchtitan is not a dependency (its import chain pulls triton, ~1 GB); ``make
test-torchtitan`` installs it and runs this file, which is skipped without it.

``apply_fsdp_to_decoder`` shards a torchtitan Llama 3 exactly as torchtitan's trainer
does: ``fully_shard`` from ``torch.distributed.fsdp`` with torch's
``MixedPrecisionPolicy(cast_forward_inputs=False)``, ``[norm, lm_head]`` as one unit,
every block, the root, ``isinstance(m, FSDPModule)`` checks and
``set_gradient_divide_factor(1.0)`` (the loss is divided by the global token count).
torch's FSDP2 cannot run that last setting on gloo (PREMUL_SUM), so the reference is
single-process training. FlexAttention has no CPU backward: the model's attention
kernel is swapped for the same causal attention in SDPA, in both runs.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from fullshard.testing import run_distributed

pytest.importorskip("torchtitan")

STEPS, BATCH, SEQ, VOCAB = 3, 4, 32, 2048


def _causal_sdpa(q, k, v, *, scale=None, enable_gqa=False, **_):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                          enable_gqa=enable_gqa), None


def _llama():
    from torchtitan.models.common.attention import FlexAttention
    from torchtitan.models.llama3 import llama3_configs
    FlexAttention.compiled_flex_attn = staticmethod(_causal_sdpa)
    torch.manual_seed(0)
    model = llama3_configs["debugmodel"]("flex").build()
    model.init_states()
    return model


def _steps(model, rank: int, world: int) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for step in range(STEPS):
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1),
                               generator=torch.Generator().manual_seed(step))
        x, y = tokens[:, :-1].chunk(world)[rank], tokens[:, 1:].chunk(world)[rank]
        positions = torch.arange(SEQ).expand(x.shape[0], -1)
        logits = model(x, positions, model.get_attention_masks(positions))
        # torchtitan's convention: sum over tokens / global token count, no FSDP division
        loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(),
                               reduction="sum") / (BATCH * SEQ)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if world > 1:
            loss = loss.detach().clone()
            dist.all_reduce(loss)
        losses.append(loss.item())
    return losses


def _sharded():
    import fullshard
    fullshard.install()
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.distributed.fsdp import apply_fsdp_to_decoder

    model = _llama()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("fsdp",))
    apply_fsdp_to_decoder(model, mesh, param_dtype=torch.float32, reduce_dtype=torch.float32,
                          pp_enabled=False)
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    assert all(type(m).__module__.startswith("fullshard") for m in units)
    return len(units), _steps(model, dist.get_rank(), dist.get_world_size())


def test_torchtitan_apply_fsdp_trains_as_single_process():
    units, losses = run_distributed(_sharded, 2, timeout=600)[0]
    assert units == 6 + 1 + 2 + 1  # blocks, tok_embeddings, [norm, lm_head], the root
    reference = _steps(_llama(), 0, 1)
    assert losses == pytest.approx(reference, rel=1e-5)
