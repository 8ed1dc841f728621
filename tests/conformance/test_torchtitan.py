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

The mixture-of-experts models (Qwen3-MoE, DeepSeek-V3) go through torchtitan's own
``parallelize_qwen3`` / ``parallelize_deepseekv3`` with FSDP alone (expert parallel
degree 1, the ``partial_dtensor`` backend): each MoE block is one unit holding its
router, shared experts and grouped experts. Their experts run torch's
``_grouped_mm`` in bf16 (it has a CPU kernel, forward and backward), so a rank's expert
gradients are bf16 sums over its quarter of the tokens where the reference sums all of
them in one kernel: losses and gradient norms agree to 1e-4, not to fp32's 1e-5.
With expert parallel 2 (x expert FSDP 2) their block calls put the experts on a mesh of
their own (``ShardPlacementResult``), and tokens reach the experts' ranks through
torchtitan's all-to-all dispatcher; a save of what its CheckpointManager saves resumes
at expert parallel 2, and at 1 through DCP's resharding, like a straight run.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import Shard

from fullshard.testing import run_distributed

pytest.importorskip("torchtitan")
# minutes of 4-rank runs: make test-torchtitan runs them; make test and test-fast do not,
# where torchtitan happens to be installed
pytestmark = [pytest.mark.slow, pytest.mark.extended]

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


def _steps(model, rank: int, world: int, optimizer="adamw", ep: bool = False,
           steps=range(STEPS)) -> list[tuple[float, float]]:
    """(loss, gradient norm) of each step, over the whole batch; with expert parallelism
    the norm is torchtitan's (experts and the rest on meshes of their own). ``optimizer``:
    "adamw", "sgd" or an optimizer of ``model``."""
    opt = (torch.optim.AdamW(model.parameters(), lr=1e-3) if optimizer == "adamw" else
           torch.optim.SGD(model.parameters(), lr=1e-2) if optimizer == "sgd" else optimizer)
    losses = []
    for step in steps:
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1),
                               generator=torch.Generator().manual_seed(step))
        x, y = tokens[:, :-1].chunk(world)[rank], tokens[:, 1:].chunk(world)[rank]
        positions = torch.arange(SEQ).expand(x.shape[0], -1)
        logits = model(x, positions, model.get_attention_masks(positions))
        # torchtitan's convention: sum over tokens / global token count, no FSDP division
        loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(),
                               reduction="sum") / (BATCH * SEQ)
        loss.backward()
        if ep:
            from torchtitan.distributed.utils import clip_grad_norm_
            norm = clip_grad_norm_(list(model.parameters()), float("inf"), ep_enabled=True)
        else:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        opt.step()
        opt.zero_grad()
        if world > 1:
            loss = loss.detach().clone()
            dist.all_reduce(loss)
        losses.append((loss.item(), norm.item()))
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
    assert [loss for loss, _ in losses] == pytest.approx([loss for loss, _ in reference],
                                                         rel=1e-5)


def _moe(name: str, ep: bool = False, seed: int = 0):
    """torchtitan's debug configuration of ``name``, its first two blocks (DeepSeek-V3: the
    dense block and an MoE block; Qwen3: two MoE blocks of 64 experts), so that four
    ranks and the reference train it within minutes on two cores. ``ep``: with the
    sharding configuration torchtitan's trainer sets for expert parallelism."""
    from torchtitan.models.common.attention import FlexAttention
    FlexAttention.compiled_flex_attn = staticmethod(_causal_sdpa)
    if name == "qwen3":
        from torchtitan.models.qwen3 import qwen3_configs
        from torchtitan.models.qwen3.sharding import set_qwen3_sharding_config as sharding
        config = qwen3_configs["debugmodel_moe"]("flex")
    else:
        from torchtitan.models.deepseek_v3 import deepseekv3_configs
        from torchtitan.models.deepseek_v3.sharding import (
            set_deepseek_v3_sharding_config as sharding)
        config = deepseekv3_configs["debugmodel"]("flex", "standard")
    config.layers = config.layers[:2]
    if ep:
        sharding(config, enable_sp=False, enable_ep=True)
    torch.manual_seed(seed)
    model = config.build()
    model.init_states()
    return model


def _sharded_moe(name: str, ep: int = 1):
    model, placements = _sharded_moe_model(name, ep)
    return placements, _steps(model, dist.get_rank(), dist.get_world_size(), optimizer="sgd",
                              ep=ep > 1)


def _sharded_moe_model(name: str, ep: int = 1, seed: int = 0):
    """torchtitan's parallelize for ``name`` on fullshard; (the model, its experts'
    placements and mesh dimensions)."""
    import fullshard
    fullshard.install()
    import torchtitan.distributed.parallel_dims as parallel_dims
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed.utils import set_spmd_backend
    from torchtitan.models.deepseek_v3.parallelize import parallelize_deepseekv3
    from torchtitan.models.qwen3.parallelize import parallelize_qwen3

    parallel_dims.device_type = "cpu"  # torchtitan builds its meshes on the accelerator
    set_spmd_backend("partial_dtensor")  # what its trainer sets from the same flag
    model = _moe(name, ep=ep > 1, seed=seed)
    world = dist.get_world_size()
    dims = parallel_dims.ParallelDims(dp_replicate=1, dp_shard=world, cp=1, tp=1, pp=1, ep=ep,
                                      world_size=world, spmd_backend="partial_dtensor")
    dims.build_mesh()
    parallelize = parallelize_qwen3 if name == "qwen3" else parallelize_deepseekv3
    parallelize(model, parallel_dims=dims,
                training=TrainingConfig(mixed_precision_param="float32",
                                        mixed_precision_reduce="float32"),
                parallelism=ParallelismConfig(spmd_backend="partial_dtensor",
                                              expert_parallel_degree=ep),
                compile_config=CompileConfig(enable=False), ac_config=None,
                dump_folder=".")
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    assert units and all(type(m).__module__.startswith("fullshard") for m in units)
    experts = next(m for m in model.modules() if type(m).__name__ == "GroupedExperts")
    return model, (experts.w1_EFD.placements, experts.w1_EFD.device_mesh.mesh_dim_names)


@pytest.mark.parametrize("name", ["qwen3", "deepseek_v3"])
def test_torchtitan_moe_fsdp_trains_as_single_process(name):
    (placements, _), steps = run_distributed(_sharded_moe, 4, name, timeout=900)[0]
    assert placements == (Shard(0),)  # experts outnumber the ranks: torchtitan's Shard(0)
    reference = _steps(_moe(name), 0, 1, optimizer="sgd")
    for step, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(steps, reference)):
        assert loss == pytest.approx(ref_loss, rel=1e-4), f"loss at step {step}"
        assert norm == pytest.approx(ref_norm, rel=1e-4), f"gradient norm at step {step}"


@pytest.mark.parametrize("name", ["qwen3", "deepseek_v3"])
def test_torchtitan_moe_fsdp_with_expert_parallel_trains_as_single_process(name):
    """Expert parallel 2 x expert FSDP 2: torchtitan's block call puts the experts on the
    ``efsdp`` mesh through ``ShardPlacementResult`` (Note [parameters on meshes of their
    own]); its all-to-alls carry the tokens to the experts' ranks."""
    (placements, dims), steps = run_distributed(_sharded_moe, 4, name, 2, timeout=900)[0]
    assert dims == ("efsdp", "ep") and placements[1] == Shard(0)
    assert "StridedShard" in type(placements[0]).__name__  # local experts over efsdp
    reference = _steps(_moe(name), 0, 1, optimizer="sgd")
    for step, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(steps, reference)):
        assert loss == pytest.approx(ref_loss, rel=1e-4), f"loss at step {step}"
        assert norm == pytest.approx(ref_norm, rel=1e-4), f"gradient norm at step {step}"


def _resumed_moe(name: str, directory: str, load_ep: int) -> tuple[list, list]:
    """Expert parallel 2 x expert FSDP 2: steps 0-1, a save of what torchtitan's
    CheckpointManager saves (its ModelWrapper's state dict, the optimizer's through torch
    DCP's ``get_optimizer_state_dict``), a fresh model and optimizer at expert parallel
    ``load_ep`` loaded from it, step 2; against the same three steps straight through."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_optimizer_state_dict,
                                                           set_optimizer_state_dict)
    from torchtitan.components.checkpointer.base import ModelWrapper

    def build(seed=0, ep=2):
        model, _ = _sharded_moe_model(name, ep, seed=seed)
        return model, torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)

    def train(model, opt, steps, ep=True):
        return _steps(model, dist.get_rank(), dist.get_world_size(), optimizer=opt, ep=ep,
                      steps=steps)

    expected = train(*build(), range(3))
    model, opt = build()
    before = train(model, opt, range(2))
    dcp.save({"model": ModelWrapper(model).state_dict(),
              "optimizer": get_optimizer_state_dict(model, opt)}, checkpoint_id=directory)
    model, opt = build(seed=1, ep=load_ep)  # other weights until loaded
    wrapper = ModelWrapper(model)
    state = {"model": wrapper.state_dict(), "optimizer": get_optimizer_state_dict(model, opt)}
    dcp.load(state, checkpoint_id=directory)
    wrapper.load_state_dict(state["model"])
    set_optimizer_state_dict(model, opt, state["optimizer"])
    return expected, before + train(model, opt, range(2, 3), ep=load_ep > 1)


@pytest.mark.parametrize("name", ["qwen3", "deepseek_v3"])
@pytest.mark.parametrize("load_ep", [2, 1])
def test_torchtitan_moe_with_expert_parallel_resumes_from_dcp_like_a_straight_run(
        name, load_ep, tmp_path):
    """At expert parallel 1 the checkpoint is resharded into FSDP alone: the experts' sums
    then run in another order (bf16 grouped mm), 1e-4 as against one process."""
    expected, resumed = run_distributed(_resumed_moe, 4, name, str(tmp_path), load_ep,
                                        timeout=900)[0]
    flat = [x for pair in resumed for x in pair]
    assert flat == pytest.approx([x for pair in expected for x in pair],
                                 rel=1e-6 if load_ep == 2 else 1e-4)
