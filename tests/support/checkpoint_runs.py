"""A small sharded GPT trained, saved and compared as the checkpoint tests do it."""

import os

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from fullshard import fully_shard
from fullshard import checkpoint as ckpt
from fullshard.gpt import GPT, GPTConfig, lm_loss

CFG = GPTConfig(vocab_size=40, seq_len=8, d_model=16, n_layers=3, n_heads=2)


def sharded_gpt(layout="layers", meta=False):
    """CFG's GPT: each layer and the root sharded ("layers"), the root alone
    ("root_only"; "root_zero2" keeps it gathered after forward), or not at all ("plain")."""
    torch.manual_seed(0)
    if meta:
        with torch.device("meta"):
            model = GPT(CFG)
    else:
        model = GPT(CFG)
    if layout == "plain":
        return model
    if layout == "layers":
        for layer in model.layers:
            fully_shard(layer)
    fully_shard(model, reshard_after_forward=layout != "root_zero2")
    return model


def train_step(model, opt, step):
    g = torch.Generator().manual_seed(100 * step + dist.get_rank())
    x = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len), generator=g)
    loss = lm_loss(model(x), torch.roll(x, -1, 1))
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def full_state(model):
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for k, v in model.state_dict().items()}


def full_optim(model, opt):
    """FQN -> state name -> full tensor (every rank gathers; tiny models only)."""
    osd = ckpt.get_optimizer_state_dict(model, opt)["state"]
    return {fqn: {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
                  for k, v in state.items()} for fqn, state in osd.items()}


def assert_same_optim(a, b):
    assert a.keys() == b.keys()
    for fqn in a:
        for k in a[fqn]:
            assert torch.equal(a[fqn][k], b[fqn][k]), (fqn, k)


def train_and_save(path, steps, save_at=None, with_optim=False):
    model = sharded_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        losses.append(train_step(model, opt, step))
        if save_at is not None and step + 1 == save_at:
            ckpt.save(os.path.join(path, f"step_{step + 1}"), model, opt,
                      extra={"step": step + 1, "note": "hello"})
    if with_optim:
        return losses, full_state(model), full_optim(model, opt)
    return losses, full_state(model)
