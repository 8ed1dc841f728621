"""FSDPModule's own methods: manual unshard and reshard, the module type and state dict
the ecosystem sees (clipping at 1, 2 and 4 ranks), forward methods other than
``forward``, and copy streams shared between roots."""

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from fullshard import FSDPModule, fully_shard
from fullshard.testing import run_distributed
from fullshard.testing.counting import count_collectives
from fullshard.gpt import GPT, lm_loss
from support.small_gpt import CFG, rank_batch, sharded_gpt


def _manual_worker():
    model = sharded_gpt()
    handle = model.unshard(async_op=True)
    handle.wait()
    root_params = [model.tok_emb.weight, model.pos_emb.weight, model.ln_f.weight]
    assert all(not isinstance(p, DTensor) for p in root_params)
    assert model.lm_head.weight is model.tok_emb.weight  # the tie holds while unsharded
    model.reshard()
    assert all(isinstance(p, DTensor) for p in model.parameters())
    model.layers[0].unshard()
    w = model.layers[0].attn.qkv.weight
    assert not isinstance(w, DTensor) and w.shape == (3 * CFG.d_model, CFG.d_model)
    model.layers[0].reshard()
    # values seen while unsharded equal the gathered DTensor
    gathered = model.layers[0].attn.qkv.weight.full_tensor()
    model.layers[0].unshard()
    torch.testing.assert_close(model.layers[0].attn.qkv.weight.detach(), gathered)
    model.layers[0].reshard()
    return True


def test_manual_unshard_reshard():
    assert run_distributed(_manual_worker, 2) == [True, True]


def _ecosystem_worker():
    torch.manual_seed(0)
    ref = GPT(CFG)
    model = copy.deepcopy(ref)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    assert isinstance(model, GPT) and isinstance(model, FSDPModule)
    assert type(model).__name__ == "FSDPGPT"
    names = [n for n, _ in model.named_parameters()]
    assert names == [n for n, _ in ref.named_parameters()]
    for p in model.parameters():
        assert isinstance(p, DTensor) and p.placements == (Shard(0),)
    x, y = rank_batch(0, n=2)
    world = dist.get_world_size()
    gx = torch.cat([_batch_for_rank(r)[0] for r in range(world)])
    gy = torch.cat([_batch_for_rank(r)[1] for r in range(world)])
    lm_loss(model(x), y).backward()
    lm_loss(ref(gx), gy).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.01)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm=0.01)
    norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
    torch.testing.assert_close(norm, ref_norm, rtol=1e-5, atol=1e-6)
    for (n, p), (_, rp) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.grad.full_tensor(), rp.grad, rtol=1e-5, atol=1e-6,
                                   msg=lambda m, n=n: f"clipped grad {n}: {m}")
    with count_collectives() as counts:
        sd = model.state_dict()
    assert not counts
    assert sd.keys() == ref.state_dict().keys()
    for k, v in sd.items():
        assert isinstance(v, DTensor) and v.placements == (Shard(0),), k
    return True


def _batch_for_rank(rank):
    g = torch.Generator().manual_seed(rank)
    x = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len), generator=g)
    return x, torch.roll(x, -1, 1)


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.slow
def test_clip_grad_norm_and_state_dict(world_size):
    assert all(run_distributed(_ecosystem_worker, world_size))


class _Decoder(torch.nn.Module):
    """``decode`` reads the parameters directly, not through ``forward``."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(6, 5)
        self.out = torch.nn.Linear(5, 3)

    def forward(self, x):
        return self.out(torch.tanh(self.proj(x)))

    def decode(self, x):
        return torch.tanh(x @ self.proj.weight.t() + self.proj.bias) @ self.out.weight.t()


def _forward_method_worker():
    from fullshard import register_fsdp_forward_method

    torch.manual_seed(0)
    ref = _Decoder()
    model = copy.deepcopy(ref)
    register_fsdp_forward_method(ref, "decode")  # a plain module: no-op
    fully_shard(model)
    with pytest.raises(ValueError, match="_Decoder has no method 'generate'"):
        register_fsdp_forward_method(model, "generate")
    register_fsdp_forward_method(model, "decode")
    x = torch.randn(4, 6)
    with torch.no_grad():
        torch.testing.assert_close(model.decode(x), ref.decode(x))
    assert all(isinstance(p, DTensor) for p in model.parameters())  # freed afterwards
    model.decode(x).sum().backward()
    ref.decode(x).sum().backward()
    world = dist.get_world_size()
    for p, rp in zip(model.parameters(), ref.parameters()):
        if rp.grad is None:  # out.bias: decode does not use it
            assert p.grad is None
            continue
        torch.testing.assert_close(p.grad.full_tensor(), rp.grad, rtol=1e-5, atol=1e-6)
    return world


def test_register_fsdp_forward_method():
    assert run_distributed(_forward_method_worker, 2) == [2, 2]


def _shared_copies_worker():
    from fullshard import share_comm_ctx
    from fullshard.core.state import unit_of
    models = [sharded_gpt() for _ in range(3)]
    x, _ = rank_batch()
    models[0](x)  # already a root when the context is shared: it moves
    share_comm_ctx(models[:2])
    for m in models:
        m(x)
    copies = [unit_of(m).root.copies for m in models]
    groups_follow = all(g.copies is copies[0] for g in unit_of(models[0]).root.members)
    return copies[0] is copies[1], copies[0] is copies[2], groups_follow


def test_share_comm_ctx_gives_the_roots_one_set_of_copy_streams():
    shared, with_third, groups_follow = run_distributed(_shared_copies_worker, 1)[0]
    assert shared and groups_follow and not with_third
