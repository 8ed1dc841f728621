"""The FSDP2 tutorial's code (seed 001) runs on fullshard with only the import changed.

The Transformer below mirrors the tutorial's model (tok_embeddings, layers, norm,
output); the test bodies follow the tutorial's snippets line by line.
"""

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

# The tutorial imports `from torch.distributed.fsdp import fully_shard, FSDPModule`.
from fullshard import FSDPModule, fully_shard
from fullshard.testing import run_distributed
from torch.distributed.tensor import DTensor, Shard, distribute_tensor


@dataclass
class ModelArgs:
    n_layers: int = 2
    vocab_size: int = 64
    max_seq_len: int = 16
    dim: int = 32
    n_heads: int = 4
    dropout_p: float = 0.0


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads = args.n_heads
        self.wq = nn.Linear(args.dim, args.dim, bias=False)
        self.wk = nn.Linear(args.dim, args.dim, bias=False)
        self.wv = nn.Linear(args.dim, args.dim, bias=False)
        self.wo = nn.Linear(args.dim, args.dim, bias=False)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (w(x).view(b, t, self.n_heads, -1).transpose(1, 2)
                   for w in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, t, d))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention_norm = nn.LayerNorm(args.dim)
        self.attention = Attention(args)
        self.ffn_norm = nn.LayerNorm(args.dim)
        self.feed_forward = nn.Sequential(nn.Linear(args.dim, 4 * args.dim), nn.GELU(),
                                          nn.Linear(4 * args.dim, args.dim))

    def forward(self, x):
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.pos_embeddings = nn.Embedding(args.max_seq_len, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_layers))
        self.norm = nn.LayerNorm(args.dim)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)

    def forward(self, tokens):
        pos = torch.arange(tokens.size(1), device=tokens.device)
        h = self.tok_embeddings(tokens) + self.pos_embeddings(pos)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def _tutorial_worker(ckpt_dir):
    rank = dist.get_rank()
    device = torch.device("cpu")
    vocab_size, batch_size, seq_len, epochs, max_norm = 64, 2, 16, 3, 1.0
    torch.manual_seed(0)

    # -- Model initialization --
    model = Transformer(ModelArgs())
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    assert isinstance(model, Transformer)
    assert isinstance(model, FSDPModule)
    assert "FSDPTransformer" in repr(model) and "FSDPTransformerBlock" in repr(model)

    for param in model.parameters():
        assert isinstance(param, DTensor)
        assert param.placements == (Shard(0),)
        param.to_local()  # the shard
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)

    # -- Training loop with explicit first all-gather and gradient clipping --
    losses = []
    for _ in range(epochs):
        model.unshard()
        x = torch.randint(0, vocab_size, (batch_size, seq_len), device=device)
        loss = model(x).sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=max_norm)
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())

    # -- Saving state dicts: full_tensor() per parameter, rank 0 writes --
    sharded_sd = model.state_dict()
    cpu_state_dict = {}
    for param_name, sharded_param in sharded_sd.items():
        full_param = sharded_param.full_tensor()
        if rank == 0:
            cpu_state_dict[param_name] = full_param.cpu()
        else:
            del full_param
    path = os.path.join(ckpt_dir, "model_state_dict.pt")
    if rank == 0:
        torch.save(cpu_state_dict, path)
    dist.barrier()

    # -- Loading state dicts into a meta-initialized model --
    with torch.device("meta"):
        model2 = Transformer(ModelArgs())
    for layer in model2.layers:
        fully_shard(layer)
    fully_shard(model2)
    full_sd = torch.load(path, mmap=True, weights_only=True, map_location="cpu")
    meta_sharded_sd = model2.state_dict()
    sharded_sd = {}
    for param_name, full_tensor in full_sd.items():
        sharded_meta_param = meta_sharded_sd.get(param_name)
        sharded_tensor = distribute_tensor(full_tensor, sharded_meta_param.device_mesh,
                                           sharded_meta_param.placements)
        sharded_sd[param_name] = nn.Parameter(sharded_tensor)
    model2.load_state_dict(sharded_sd, assign=True)

    # the loaded model computes what the trained one computes
    x = torch.randint(0, vocab_size, (batch_size, seq_len), device=device)
    with torch.no_grad():
        torch.testing.assert_close(model2(x), model(x))
    # and trains on
    optim2 = torch.optim.Adam(model2.parameters(), lr=1e-2)
    model2(x).sum().backward()
    optim2.step()
    return losses


def test_fsdp2_tutorial_runs_with_import_changed(tmp_path):
    losses = run_distributed(_tutorial_worker, 2, str(tmp_path))
    assert len(losses[0]) == 3
