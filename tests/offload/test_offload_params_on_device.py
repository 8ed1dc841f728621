"""CPUOffloadPolicy(params_on_device=True): gradients and optimizer states on the host, and a
copy of each shard kept on the compute device that gathers read, copied from the host once
per write of the shard rather than once per gather (Note [parameters kept on the device] in
core/storage.py). On a CPU-only machine both devices are the CPU and the same copies run."""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from fullshard import (CPUOffloadPolicy, DiskOffloadPolicy, MixedPrecisionPolicy,
                       OverlappedStep, fully_shard)
from fullshard.core.storage import ShardStorage
from fullshard.gpt import GPT, GPTConfig, lm_loss
from fullshard.testing import run_distributed
from fullshard.testing.models import token_batch
from fullshard.testing.parity import check_parity
from support.catalogue import matches_documented
from support.host_steps import assert_same_bits, train_and_read

CFG = GPTConfig(vocab_size=40, seq_len=10, d_model=16, n_layers=3, n_heads=2)
BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _shard(model, on_device, mp=None, merge=False, blocks=None):
    """Each block (those in ``blocks``, all by default) and the root offloaded."""
    policy = CPUOffloadPolicy(pin_memory=False, params_on_device=on_device)
    for i, layer in enumerate(model.layers):
        offloaded = blocks is None or i in blocks
        fully_shard(layer, offload_policy=policy if offloaded else None,
                    **({"mp_policy": mp} if mp else {}))
    fully_shard(model, offload_policy=policy, **({"mp_policy": mp} if mp else {}))
    if not merge:
        model.set_bucket_numel(0)
    return model


def _model(on_device, mp=None, merge=False, blocks=None):
    torch.manual_seed(0)
    return _shard(GPT(CFG), on_device, mp, merge, blocks)


def _train(on_device, mp, merge, overlapped, blocks=None):
    model = _model(on_device, mp, merge, blocks)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, fused=True)
    stepper = OverlappedStep(opt) if overlapped else opt
    return train_and_read(model, opt, stepper, "fused", CFG.vocab_size, CFG.seq_len)


def _same_bits_as_copying_from_the_host(mp, merge, overlapped, blocks):
    mp = BF16 if mp else None
    assert_same_bits(_train(False, mp, merge, overlapped, blocks),
                     _train(True, mp, merge, overlapped, blocks))
    return True


@pytest.mark.parametrize("world,mp,merge,overlapped,blocks", [
    (2, True, False, False, None),   # gathered in bf16: the copy is kept cast
    (2, False, True, False, None),   # fp32: the blocks gathered as one batch copy in
    (2, True, False, True, {1, 2}),  # stepped on the host thread, some blocks on the device
    pytest.param(3, True, True, False, None, marks=pytest.mark.slow),
])
def test_the_same_bits_as_offload_that_copies_from_the_host(world, mp, merge, overlapped,
                                                            blocks):
    assert all(run_distributed(_same_bits_as_copying_from_the_host, world, mp, merge,
                               overlapped, blocks))


def _train_on_mesh(on_device, hybrid):
    torch.manual_seed(0)
    model = GPT(CFG)
    mesh = {"mesh": init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))} \
        if hybrid else {}
    policy = CPUOffloadPolicy(pin_memory=False, params_on_device=on_device)
    for layer in model.layers:
        fully_shard(layer, offload_policy=policy, mp_policy=BF16, **mesh)
    fully_shard(model, offload_policy=policy, mp_policy=BF16, **mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=True)
    return train_and_read(model, opt, opt, "fused", CFG.vocab_size, CFG.seq_len)


def _same_bits_on_mesh(hybrid):
    assert_same_bits(_train_on_mesh(False, hybrid), _train_on_mesh(True, hybrid))
    return True


@pytest.mark.parametrize("world,hybrid", [
    (1, False),  # one rank: no collective, the copy into the gathered buffer alone
    pytest.param(4, True, marks=pytest.mark.slow),  # 2 replicas x 2 shards (HSDP)
])
def test_one_rank_and_a_replicated_mesh_give_the_same_bits(world, hybrid):
    assert all(run_distributed(_same_bits_on_mesh, world, hybrid))


def _parity_with_one_process():
    # fp32 on the CPU gathers a unit's host shard as it is (nothing to cast or move): the
    # blocks gathered as one batch copy in, from the kept copies
    report = check_parity(lambda: GPT(CFG), lambda model: _shard(model, True, merge=True),
                          lambda step: token_batch(step, 8, CFG.vocab_size, CFG.seq_len),
                          lambda model, b: lm_loss(model(b[0]), b[1]), steps=4)
    return report.max_weight_diff


def test_trains_as_one_process():
    run_distributed(_parity_with_one_process, 2)


def _host_copies_per_step(micro, steps=3):
    """How many times each step copied shards from the host into the kept copies, and the
    gathers that read those copies."""
    copies, gathers = [], []
    fresh = ShardStorage._fresh_device_copy

    def counted(storage, dtype, device):
        gathers[-1] += 1
        if storage.device_copy is None or storage._device_copy_written != storage.written():
            copies[-1] += 1
        return fresh(storage, dtype, device)

    ShardStorage._fresh_device_copy = counted
    try:
        model = _model(True, BF16)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        for step in range(steps):
            copies.append(0)
            gathers.append(0)
            for k in range(micro):
                x, y = token_batch(10 * step + k + dist.get_rank(), 4, CFG.vocab_size,
                                   CFG.seq_len)
                lm_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        kept = [m._unit.group.storage.device_copy for m in model.layers]
        assert all(c is not None and c.dtype == torch.bfloat16 for c in kept)
        host = [p.to_local() for p in model.parameters()]
        assert all(t.dtype == torch.float32 for t in host)
        assert all(p.grad is None for p in model.parameters())
        return copies, gathers
    finally:
        ShardStorage._fresh_device_copy = fresh


def test_one_copy_from_the_host_per_step_whatever_the_gathers():
    units = CFG.n_layers + 1  # the blocks and the root (embeddings, head)
    for micro in (1, 2):
        copies, gathers = run_distributed(_host_copies_per_step, 2, micro)[0]
        # resharded after forward: each micro-batch gathers each block in forward and
        # again in backward (the root stays gathered from its forward through backward)
        assert gathers == [micro * (2 * CFG.n_layers + 1)] * 3, gathers
        assert copies == [units] * 3, copies


def _writes_between_steps_reach_the_next_forward():
    def outputs(on_device):
        model = _model(on_device, BF16)  # gathers cast: they copy in, from the kept copies
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        x, y = token_batch(dist.get_rank(), 4, CFG.vocab_size, CFG.seq_len)
        seen = []
        lm_loss(model(x), y).backward()
        opt.step()
        saved = {k: v.detach().clone() for k, v in model.state_dict().items()}
        block = model.layers[1]
        writes = [
            lambda: block.attn.qkv.weight.mul_(0.5),             # an op on the parameter
            lambda: nn.init.zeros_(block.mlp.fc.bias),            # an init function
            lambda: block.mlp.fc.weight.to_local().add_(0.25),    # the local tensor
            lambda: model.load_state_dict(saved),                 # a load
        ]
        for write in writes:
            with torch.no_grad():
                write()
                seen.append(model(x).clone())
        return seen

    for a, b in zip(outputs(False), outputs(True)):
        assert torch.equal(a, b)
    return True


def test_writes_between_steps_reach_the_next_forward():
    assert all(run_distributed(_writes_between_steps_reach_the_next_forward, 2))


def _steps(model, opt, steps) -> dict:
    """Train ``steps`` (each rank its own batches); the full weights after."""
    for step in steps:
        x, y = token_batch(10 * step + dist.get_rank(), 4, CFG.vocab_size, CFG.seq_len)
        lm_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.full_tensor() for k, v in model.state_dict().items()}


def _save(model, opt, tmp) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    sd_model, sd_opt = get_state_dict(model, opt)
    dcp.save({"model": sd_model, "optim": sd_opt}, checkpoint_id=tmp)


def _load_after_a_forward(model, opt, tmp) -> None:
    """A first forward and backward build the kept copies; then the checkpoint is loaded."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    x, y = token_batch(990 + dist.get_rank(), 4, CFG.vocab_size, CFG.seq_len)
    lm_loss(model(x), y).backward()
    opt.zero_grad(set_to_none=True)
    sd_model, sd_opt = get_state_dict(model, opt)
    state = {"model": sd_model, "optim": sd_opt}
    dcp.load(state, checkpoint_id=tmp)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


def _resume(tmp):
    model = _model(True, BF16)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    _steps(model, opt, range(2))
    _save(model, opt, tmp)
    straight = _steps(model, opt, range(2, 4))

    resumed = _model(True, BF16)
    resumed_opt = torch.optim.AdamW(resumed.parameters(), lr=3e-3)
    _load_after_a_forward(resumed, resumed_opt, tmp)
    after = _steps(resumed, resumed_opt, range(2, 4))
    assert_same_bits((straight,), (after,))
    return True


def test_a_resume_trains_on_exactly(tmp_path):
    path = str(tmp_path)
    assert all(run_distributed(_resume, 2, path))


def _saved_after_two_steps(tmp):
    model = _model(True, BF16)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    _steps(model, opt, range(2))
    _save(model, opt, tmp)
    return True


def _loaded_and_trained_on(tmp, on_device):
    """The checkpoint loaded into a model whose kept copies a first forward already built
    (at this world size, another than the one that saved), then two steps."""
    model = _model(on_device, BF16)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    _load_after_a_forward(model, opt, tmp)
    return _steps(model, opt, range(2, 4))


@pytest.mark.slow
def test_a_resume_at_another_world_size_trains_on_as_copying_from_the_host(tmp_path):
    path = str(tmp_path)
    assert all(run_distributed(_saved_after_two_steps, 2, path))
    kept = run_distributed(_loaded_and_trained_on, 3, path, True)[0]
    copied = run_distributed(_loaded_and_trained_on, 3, path, False)[0]
    assert_same_bits((copied,), (kept,))


def test_misuse_is_refused_in_one_line(tmp_path):
    with pytest.raises(ValueError) as both:
        fully_shard(nn.Linear(4, 4), offload_policy=DiskOffloadPolicy(
            path=str(tmp_path), params=True, params_on_device=True))
    assert matches_documented("E386", f"ValueError: {both.value}")
    with pytest.raises(ValueError, match="params_on_device must be True or False"):
        fully_shard(nn.Linear(4, 4), offload_policy=CPUOffloadPolicy(params_on_device="yes"))
