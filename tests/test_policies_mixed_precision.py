"""Mixed precision: seed 001's example, dtypes where FSDP2 puts them, parity with FSDP2."""

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from fullshard import MixedPrecisionPolicy, fully_shard
from fullshard.testing import run_distributed
from fullshard.testing.parity import cast_reference_step
from fullshard.gpt import GPT, GPTConfig, lm_loss

CFG = GPTConfig(vocab_size=48, seq_len=12, d_model=32, n_layers=3, n_heads=4)


def _seed_example():
    """Seed 001, "Enabling Mixed Precision", with only the import changed."""
    model = GPT(CFG)
    fsdp_kwargs = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                     reduce_dtype=torch.float32)}
    for layer in model.layers:
        fully_shard(layer, **fsdp_kwargs)
    fully_shard(model, **fsdp_kwargs)
    # sharded parameters are float32
    for param in model.parameters():
        assert param.dtype == torch.float32
    # unsharded parameters are bfloat16
    model.unshard()
    for param in model.parameters(recurse=False):
        assert param.dtype == torch.bfloat16
    for param in [model.tok_emb.weight, model.ln_f.weight]:  # the root's own, gathered
        assert param.dtype == torch.bfloat16 and not isinstance(param, DTensor)
    model.reshard()
    # optimizer states are in float32
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    x = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len))
    loss = lm_loss(model(x), torch.roll(x, -1, 1))
    assert loss.dtype == torch.bfloat16  # computed in bf16
    loss.backward()
    for param in model.parameters():  # gradients reach the optimizer in float32
        assert isinstance(param.grad, DTensor) and param.grad.dtype == torch.float32
    optim.step()
    for state in optim.state.values():
        assert state["exp_avg"].dtype == torch.float32
    return True


def test_seed_mixed_precision_example():
    assert all(run_distributed(_seed_example, 2))


def _policy(kind, index):
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if kind == "bf16":
        return bf16
    if kind == "bf16_reduce_bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    if kind == "first_fp32":  # the first block in fp32 (its inputs cast up), the rest bf16
        return MixedPrecisionPolicy(param_dtype=torch.float32) if index == 0 else bf16
    raise ValueError(kind)


def _shard(model, impl, kind):
    if impl == "fullshard":
        shard_fn, policy_cls = fully_shard, MixedPrecisionPolicy
    else:
        from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy
        from torch.distributed.fsdp import fully_shard as shard_fn
        policy_cls = TorchPolicy

    def convert(p):
        return policy_cls(param_dtype=p.param_dtype, reduce_dtype=p.reduce_dtype,
                          output_dtype=p.output_dtype, cast_forward_inputs=p.cast_forward_inputs)
    for i, layer in enumerate(model.layers):
        shard_fn(layer, mp_policy=convert(_policy(kind, i)))
    shard_fn(model, mp_policy=convert(_policy(kind, 1)))
    return model


def _versus_fsdp2(kind):
    torch.manual_seed(0)
    base = GPT(CFG)
    ours = _shard(copy.deepcopy(base), "fullshard", kind)
    theirs = _shard(copy.deepcopy(base), "fsdp2", kind)
    opts = [torch.optim.AdamW(m.parameters(), lr=3e-3) for m in (ours, theirs)]
    losses = []
    for step in range(10):
        g = torch.Generator().manual_seed(100 * step + dist.get_rank())
        x = torch.randint(0, CFG.vocab_size, (4, CFG.seq_len), generator=g)
        pair = []
        for model, opt in zip((ours, theirs), opts):
            loss = lm_loss(model(x), torch.roll(x, -1, 1))
            loss.backward()
            opt.step()
            opt.zero_grad()
            pair.append(loss.float().item())
        losses.append(pair)
    for (a, b) in losses:
        assert abs(a - b) <= 2e-2 * abs(b), losses
    for p, q in zip(ours.parameters(), theirs.parameters()):
        torch.testing.assert_close(p.full_tensor(), q.full_tensor(), rtol=0.05, atol=2e-3)
    return losses


@pytest.mark.parametrize("kind", ["bf16", "bf16_reduce_bf16", "first_fp32"])
@pytest.mark.slow
def test_losses_match_fsdp2_with_the_same_policy(kind):
    run_distributed(_versus_fsdp2, 2, kind)


def _fp16_with_grad_scaler():
    torch.manual_seed(0)
    model = GPT(CFG)
    policy = MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)
    for layer in model.layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    scales, changed = [], []
    for step in range(4):
        x = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len))
        loss = lm_loss(model(x), torch.roll(x, -1, 1))
        assert loss.dtype == torch.float16
        scaler.scale(loss).backward()
        if step == 2 and dist.get_rank() == 1:  # an overflow on one rank only
            next(model.parameters()).grad._local_tensor.fill_(float("inf"))
        before = [p.to_local().clone() for p in model.parameters()]
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        changed.append(any(not torch.equal(b, p.to_local())
                           for b, p in zip(before, model.parameters())))
        scales.append(scaler.get_scale())
    return scales, changed


def test_fp16_loss_scaling_agrees_across_ranks():
    """torch.amp.GradScaler works on fullshard's sharded gradients: an inf on one rank
    makes every rank skip the step and halve the scale."""
    results = run_distributed(_fp16_with_grad_scaler, 2)
    assert results[0] == results[1]
    scales, changed = results[0]
    assert scales == [1024.0, 1024.0, 512.0, 512.0]
    assert changed == [True, True, False, True]


def _no_sync_in_reduce_dtype(kind):
    """bf16 compute with fp32 reduction, gradients accumulated without sync over 3
    micro-batches: the accumulator is fp32 (as FSDP2's), and every accumulated gradient
    is FSDP2's to bf16 rounding (torch 2.15 sums a tied weight's two gradients in another
    order, and the difference carries into later steps: within 2% of each gradient's largest
    value); losses stay within bf16 tolerance."""
    torch.manual_seed(0)
    base = GPT(CFG)
    ours = _shard(copy.deepcopy(base), "fullshard", kind)
    theirs = _shard(copy.deepcopy(base), "fsdp2", kind)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (ours, theirs)]
    dtypes = set()
    for step in range(3):
        for micro in range(3):
            g = torch.Generator().manual_seed(10 * step + micro + 100 * dist.get_rank())
            x = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len), generator=g)
            losses = []
            for model in (ours, theirs):
                model.set_requires_gradient_sync(micro == 2)
                loss = lm_loss(model(x), torch.roll(x, -1, 1))
                loss.backward()
                losses.append(loss.float().item())
            assert abs(losses[0] - losses[1]) <= 2e-2 * abs(losses[1]), losses
            if micro < 2:
                dtypes |= {p.accumulated_grad.dtype for p in ours.layers[0]._unit.group.params
                           if p.accumulated_grad is not None}
        for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
            mine, torchs = p.grad.full_tensor(), q.grad.full_tensor()
            assert mine.dtype == torchs.dtype == torch.float32, name
            torch.testing.assert_close(mine, torchs, rtol=0, atol=2e-2 * torchs.abs().max(),
                                       msg=lambda m, n=name: f"step {step} {n}: {m}")
        for opt in opts:
            opt.step()
            opt.zero_grad()
    return sorted(map(str, dtypes))


@pytest.mark.slow
def test_accumulation_without_sync_in_reduce_dtype():
    assert run_distributed(_no_sync_in_reduce_dtype, 2, "bf16")[0] == ["torch.float32"]


def _versus_cast_reference():
    """A single-process reference that applies the same casts: fp32 master weights, a
    bf16 copy for forward/backward on the whole batch, fp32 gradients into SGD (Adam
    would turn bf16 noise in the attention key bias's ~0 gradients into lr-sized steps)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    master = GPT(CFG)
    model = _shard(copy.deepcopy(master), "fullshard", "bf16")
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(master.parameters(), lr=0.05, momentum=0.9)
    for step in range(6):
        g = torch.Generator().manual_seed(step)
        x = torch.randint(0, CFG.vocab_size, (2 * world, CFG.seq_len), generator=g)
        y = torch.roll(x, -1, 1)
        local = slice(2 * rank, 2 * rank + 2)
        loss = lm_loss(model(x[local]), y[local])
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_loss = cast_reference_step(master, ref_opt, lambda low: lm_loss(low(x), y),
                                       torch.bfloat16)
        mean = loss.detach().float()
        dist.all_reduce(mean)
        assert abs(mean.item() / world - ref_loss.float().item()) <= 2e-2 * ref_loss.float().item()
    for p, q in zip(model.parameters(), master.parameters()):
        torch.testing.assert_close(p.full_tensor(), q, rtol=0.05, atol=5e-3)
    return True


def test_matches_a_reference_with_the_same_casts():
    assert all(run_distributed(_versus_cast_reference, 2))


def test_reduce_dtype_none_follows_the_installed_torch():
    """Note [torch versions]: from torch 2.15 FSDP2 reduces in the parameters' dtype when
    reduce_dtype is None, before it in param_dtype; the FSDP1 front always in param_dtype."""
    from fullshard.fsdp1.construct import _unit_mp_policy
    from fullshard.fsdp1.options import MixedPrecision
    from fullshard.torch_version import VERSION

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    expected = torch.float32 if VERSION >= (2, 15) else torch.bfloat16
    assert policy.reduce_dtype_for(torch.float32) == expected
    assert MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float16) \
        .reduce_dtype_for(torch.float32) == torch.float16
    fsdp1 = _unit_mp_policy(MixedPrecision(param_dtype=torch.bfloat16), False, False)
    assert fsdp1.reduce_dtype_for(torch.float32) == torch.bfloat16


@pytest.mark.slow
def test_a_torch_older_than_supported_is_refused_at_import():
    import subprocess
    import sys

    program = ("import torch; torch.__version__ = '2.10.1'\n"
               "try:\n    import fullshard\nexcept ImportError as err:\n    print(err)\n")
    out = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                         timeout=120)
    assert out.stdout.strip() == ("fullshard needs torch 2.11 or newer; torch 2.10.1 is "
                                  "installed. Upgrade it: pip install 'torch>=2.11'"), out
