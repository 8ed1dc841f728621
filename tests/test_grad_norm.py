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
