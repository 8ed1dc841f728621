"""fullshard.clip_grad_norm_ on gradients offloaded to the host: the norm is reduced on
the mesh's device whatever device the gradients live on (on a GPU, NCCL beside the host's
gradients), and equals one process's."""

import pytest
import torch

from fullshard import CPUOffloadPolicy, clip_grad_norm_, fully_shard
from fullshard.gpt import GPT, GPTConfig, lm_loss
from fullshard.testing import run_distributed
from fullshard.testing.models import token_batch

CFG = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=2, n_heads=4)


def _clip_offloaded():
    torch.manual_seed(0)
    model = GPT(CFG)
    reference = GPT(CFG)
    reference.load_state_dict(model.state_dict())
    for layer in model.layers:
        fully_shard(layer, offload_policy=CPUOffloadPolicy(pin_memory=False))
    fully_shard(model, offload_policy=CPUOffloadPolicy(pin_memory=False))
    x, y = token_batch(0, 4, CFG.vocab_size, CFG.seq_len)
    rank = torch.distributed.get_rank()
    lm_loss(model(x[2 * rank:2 * rank + 2]), y[2 * rank:2 * rank + 2]).backward()
    lm_loss(reference(x), y).backward()
    norm = clip_grad_norm_(model.parameters(), 0.01)
    ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.01)
    torch.testing.assert_close(norm, ref_norm, rtol=1e-5, atol=1e-6)
    for p, q in zip(model.parameters(), reference.parameters()):
        assert p.grad.to_local().device.type == "cpu"
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=1e-5, atol=1e-7)
    return float(norm)


@pytest.mark.slow
def test_clipping_offloaded_gradients_matches_one_process():
    """What the trainer calls (fullshard.clip_grad_norm_: the norm is reduced on the mesh's
    device whatever device the gradients live on)."""
    norms = run_distributed(_clip_offloaded, 2)
    assert norms[0] == norms[1] > 0.01


def test_an_infinite_max_norm_measures_without_touching_the_gradients(monkeypatch):
    """Clipping off (max_norm inf): the norm, and no kernel over the gradients."""
    params = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(4))]
    params[0].grad, params[1].grad = torch.full((3,), 3.0), torch.full((4,), 2.0)
    real, multiplied = torch._foreach_mul_, []

    def counted(tensors, scalar):
        multiplied.append(len(tensors))
        return real(tensors, scalar)

    monkeypatch.setattr(torch, "_foreach_mul_", counted)
    norm = clip_grad_norm_(params, float("inf"))
    assert norm.item() == pytest.approx((9 * 3 + 4 * 4) ** 0.5)
    assert multiplied == []
    clip_grad_norm_(params, 1.0)
    assert multiplied == [2]
    clipped = torch.stack([p.grad.norm() for p in params]).norm().item()
    assert clipped == pytest.approx(1.0, rel=1e-5)


def _offloaded_gpt(seed=0):
    torch.manual_seed(seed)
    model = GPT(CFG)
    reference = GPT(CFG)
    reference.load_state_dict(model.state_dict())
    for layer in model.layers:
        fully_shard(layer, offload_policy=CPUOffloadPolicy(pin_memory=False))
    fully_shard(model, offload_policy=CPUOffloadPolicy(pin_memory=False))
    return model, reference


def _host_norm_passes(monkeypatch_target):
    """Counts torch._foreach_norm calls (the clip's pass over gradients)."""
    real, calls = torch._foreach_norm, []

    def counted(tensors, *args, **kwargs):
        calls.append([t.device.type for t in tensors])
        return real(tensors, *args, **kwargs)

    monkeypatch_target.setattr(torch, "_foreach_norm", counted)
    return calls


def _measured_clip_reads_no_host_gradient():
    import pytest as _pytest
    model, _ = _offloaded_gpt()
    x, y = token_batch(0, 4, CFG.vocab_size, CFG.seq_len)
    lm_loss(model(x), y).backward()
    exact = clip_grad_norm_.__globals__["_combine"]  # the host pass, for the comparison
    local = [p.grad.to_local() for p in model.parameters()]
    host = exact(clip_grad_norm_.__globals__["_parts_on"](local, 2.0, torch.device("cpu")),
                 2.0, torch.device("cpu"))
    torch.distributed.all_reduce(host)
    with _pytest.MonkeyPatch.context() as mp:
        calls = _host_norm_passes(mp)
        norm = clip_grad_norm_(model.parameters(), float("inf"))
    assert calls == [], "the clip read the host gradients for the norm"
    assert torch.equal(norm, host.sqrt()), (norm, host.sqrt())  # the same bits on the CPU
    # a gradient changed after the backward: the exact path, never the stale norm
    next(iter(model.parameters())).grad.mul_(2)
    with _pytest.MonkeyPatch.context() as mp:
        calls = _host_norm_passes(mp)
        changed = clip_grad_norm_(model.parameters(), float("inf"))
    assert calls and all(d == ["cpu"] * len(d) for d in calls), calls
    full = torch.cat([p.grad.full_tensor().flatten() for p in model.parameters()])
    torch.testing.assert_close(changed, full.norm(), rtol=1e-6, atol=0)
    assert changed > norm
    return float(norm)


@pytest.mark.slow
def test_a_clip_after_an_offloaded_backward_uses_the_norms_measured_on_the_device():
    """No pass over host gradients for the norm; ``p.grad.mul_(2)`` after the backward
    falls back to reading them (Note [gradient norms measured before the copy to the
    host])."""
    norms = run_distributed(_measured_clip_reads_no_host_gradient, 2)
    assert norms[0] == norms[1] > 0


def _train_clipped(steps, measured):
    """``steps`` of offloaded training with clipping; the norms and the final weights."""
    import fullshard.grad_norm as grad_norm
    model, _ = _offloaded_gpt()
    if not measured:  # today's pass over the host gradients
        real, grad_norm.squared_sum = grad_norm.squared_sum, lambda grads: None
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    norms = []
    try:
        for step in range(steps):
            x, y = token_batch(step, 6, CFG.vocab_size, CFG.seq_len)
            part = slice(6 // world * rank, 6 // world * (rank + 1))
            lm_loss(model(x[part]), y[part]).backward()
            norms.append(clip_grad_norm_(model.parameters(), 0.05))
            opt.step()
            opt.zero_grad()
    finally:
        if not measured:
            grad_norm.squared_sum = real
    return torch.stack(norms), [p.full_tensor() for p in model.parameters()]


def _train_reference(steps, world):
    torch.manual_seed(0)
    model = GPT(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    norms = []
    for step in range(steps):
        x, y = token_batch(step, 6, CFG.vocab_size, CFG.seq_len)
        losses = [lm_loss(model(x[6 // world * r:6 // world * (r + 1)]),
                          y[6 // world * r:6 // world * (r + 1)]) for r in range(world)]
        (sum(losses) / world).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05))
        opt.step()
        opt.zero_grad()
    return torch.stack(norms), [p.detach() for p in model.parameters()]


def _measured_and_host_clips_train_alike():
    measured_norms, measured = _train_clipped(5, measured=True)
    host_norms, host = _train_clipped(5, measured=False)
    assert torch.equal(measured_norms, host_norms)
    for a, b in zip(measured, host):
        assert torch.equal(a, b)
    world = torch.distributed.get_world_size()
    ref_norms, ref = _train_reference(5, world)
    torch.testing.assert_close(measured_norms, ref_norms, rtol=1e-5, atol=1e-6)
    for a, b in zip(measured, ref):  # Adam's normalized update magnifies the rounding
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)  # of tiny mean gradients
    return (measured_norms > 0.05).sum().item()  # steps that were clipped


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_offloaded_training_with_measured_norms_matches_the_host_pass_and_one_process(world):
    """5 clipped steps: the same norms and weights, bit for bit, as reading the host
    gradients (on the CPU); one process's within the data-parallel mean's rounding."""
    clipped = run_distributed(_measured_and_host_clips_train_alike, world)
    assert clipped[0] > 0  # the clip did scale some steps
