"""A small GPT (decoder-only transformer), readable top to bottom.

Used by the trainer, the memory estimator, the examples, the tests and the benchmarks. ``layers`` holds the blocks
(the natural unit for ``fully_shard``); the output projection shares its weight
with the token embedding when ``tie_embeddings`` is set. With ``n_experts`` each block's
MLP is a mixture of experts (Mixtral-style: a top-k router, a load-balancing auxiliary
loss that ``gpt_loss`` adds). Its experts are a ``ModuleList`` of expert MLPs, or with
``grouped_experts`` the same MLPs as stacked 3-D weights (torchtitan's grouped experts),
which ``split_experts`` can spread over the ranks of an expert-parallel mesh.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Shard


@dataclass(frozen=True)
class GPTConfig:
    """Shape of the model."""

    vocab_size: int = 512
    """Number of token ids."""
    seq_len: int = 64
    """Longest sequence the position embedding covers."""
    d_model: int = 64
    """Width of the residual stream."""
    n_layers: int = 2
    """Number of transformer blocks."""
    n_heads: int = 4
    """Attention heads per block (must divide d_model)."""
    tie_embeddings: bool = True
    """Share the token embedding with the output projection."""
    mlp_ratio: int = 4
    """Hidden width of the MLP (of each expert) as a multiple of d_model."""
    n_experts: int = 0
    """0: one MLP per block; N > 0: a mixture of N expert MLPs per block."""
    top_k: int = 2
    """Experts each token is sent to (with n_experts)."""
    aux_loss_coef: float = 0.01
    """Weight of the load-balancing loss in ``gpt_loss`` (with n_experts)."""
    grouped_experts: bool = False
    """With n_experts: each block's experts as stacked weights, ``(n_experts, out, in)``
    per layer, instead of a ModuleList of MLPs; needed to split them over ranks (expert
    parallelism)."""

    def __post_init__(self) -> None:
        if self.n_heads < 1:
            raise ValueError(f"GPTConfig: n_heads={self.n_heads} must be at least 1")
        if self.d_model % self.n_heads:
            raise ValueError(f"GPTConfig: d_model={self.d_model} is not divisible by "
                             f"n_heads={self.n_heads}")
        if self.n_experts and not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"GPTConfig: top_k={self.top_k} must be between 1 and "
                             f"n_experts={self.n_experts}")

    def num_params(self) -> int:
        """Every parameter (all experts)."""
        return self._count(max(self.n_experts, 1))

    def active_params(self) -> int:
        """The parameters one token computes with (its top_k experts of each block)."""
        return self._count(min(self.top_k, self.n_experts) if self.n_experts else 1)

    def _count(self, mlps: int) -> int:
        d, v = self.d_model, self.vocab_size
        mlp = 2 * self.mlp_ratio * d * d + self.mlp_ratio * d + d
        router = d * self.n_experts
        block = 4 * d + (3 * d * d + 3 * d) + (d * d + d) + mlps * mlp + router
        head = 0 if self.tie_embeddings else v * d
        return v * d + self.seq_len * d + self.n_layers * block + 2 * d + head


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model)
        self.proj = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


def top_k_routing(router: nn.Module, tokens: torch.Tensor, top_k: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mixtral's routing: the router's probabilities over experts, each token's ``top_k``
    experts (``chosen``) and their probabilities renormalized over those k (``weights``)."""
    probs = router(tokens).softmax(dim=-1)
    weights, chosen = probs.topk(top_k, dim=-1)
    return probs, weights / weights.sum(dim=-1, keepdim=True), chosen


class ExpertList(nn.ModuleList):
    """One MLP module per expert. An expert given no rows does not run, so its
    parameters get no gradient in that step (on one rank and not another: an everyday
    case sharding must handle)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__(MLP(cfg) for _ in range(cfg.n_experts))

    def forward(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Expert ``e`` on the next ``counts[e]`` of ``rows`` (sorted by expert)."""
        outs = [self[e](part) for e, part in enumerate(rows.split(counts)) if counts[e]]
        return torch.cat(outs) if outs else rows[:0]


class GroupedLinear(nn.Module):
    """``n`` linear layers as one ``(n, out, in)`` weight and one ``(n, out)`` bias. Split
    over ranks (``split_experts``) they are DTensors ``Shard(0)``, and this rank computes
    with its own rows of them."""

    stacked = True  # each parameter is n of them: no matrix for Muon (whole_matrix/recipe.py)

    def __init__(self, n: int, d_in: int, d_out: int):
        super().__init__()
        bound = d_in ** -0.5  # nn.Linear's default init
        self.weight = nn.Parameter(torch.empty(n, d_out, d_in).uniform_(-bound, bound))
        self.bias = nn.Parameter(torch.empty(n, d_out).uniform_(-bound, bound))

    def local(self) -> tuple[torch.Tensor, torch.Tensor]:
        w, b = self.weight, self.bias
        return (w.to_local() if isinstance(w, DTensor) else w,
                b.to_local() if isinstance(b, DTensor) else b)


class GroupedExperts(nn.Module):
    """The experts' MLPs stacked: ``fc`` and ``proj`` each one ``GroupedLinear``. Every
    expert's weights are in the same tensors, so they always get a gradient, zero where
    no row went."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        hidden = cfg.mlp_ratio * cfg.d_model
        self.fc = GroupedLinear(cfg.n_experts, cfg.d_model, hidden)
        self.proj = GroupedLinear(cfg.n_experts, hidden, cfg.d_model)

    def forward(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """This rank's expert ``e`` on the next ``counts[e]`` of ``rows`` (sorted)."""
        (w1, b1), (w2, b2) = self.fc.local(), self.proj.local()
        parts = rows.split(counts)
        ran = [e for e in range(len(counts)) if counts[e]] or [0]
        # with no rows at all expert 0 runs on none: the output still depends on the
        # weights (their gradient is zero, as for the experts no row went to when others
        # ran, and not missing on this rank only) and on ``rows`` (under expert
        # parallelism the all-to-all that brought them runs in backward on every rank)
        return torch.cat([F.linear(F.gelu(F.linear(parts[e], w1[e], b1[e])), w2[e], b2[e])
                          for e in ran])


class MoE(nn.Module):
    """A mixture of expert MLPs, Mixtral-style: each token goes to the ``top_k`` experts
    its router scores highest, weighted by their probabilities renormalized over those k.
    ``aux_loss`` is the Switch Transformer's load-balancing loss of the last forward:
    n_experts * sum_e (share of assignments to e) * (mean router probability of e).
    With ``ep_group`` set (``split_experts``) this rank holds ``n_experts / ep`` of the
    experts, and rows travel to the rank of their expert and back (``exchange_rows``)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.top_k, self.n_experts = cfg.top_k, cfg.n_experts
        self.router = nn.Linear(cfg.d_model, cfg.n_experts, bias=False)
        self.experts = GroupedExperts(cfg) if cfg.grouped_experts else ExpertList(cfg)
        self.aux_loss: torch.Tensor | None = None
        self.ep_group: dist.ProcessGroup | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        probs, weights, chosen = top_k_routing(self.router, tokens, self.top_k)
        combined = mix_experts(self.experts, tokens, weights, chosen, self._counts(chosen),
                               self.ep_group)
        n = self.n_experts
        share = F.one_hot(chosen, n).sum(dim=(0, 1)).to(probs.dtype) / chosen.numel()
        self.aux_loss = n * (share * probs.mean(dim=0)).sum()
        return combined.view_as(x)

    def _counts(self, chosen: torch.Tensor) -> torch.Tensor:
        """Rows per expert. On the meta device (the memory estimator's trace) routing is
        unknown: the experts share the rows evenly."""
        n = self.n_experts
        if not chosen.is_meta:
            return torch.bincount(chosen.flatten(), minlength=n)
        q, r = divmod(chosen.numel(), n)
        return torch.tensor([q + (e < r) for e in range(n)], device="cpu")


def mix_experts(experts, tokens: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor,
                counts: torch.Tensor, ep_group: dist.ProcessGroup | None) -> torch.Tensor:
    """Each token through its ``chosen`` experts, their outputs summed with ``weights``
    (as ``top_k_routing`` gives them; ``counts``: rows per expert). ``experts(rows,
    counts)`` runs on the rows sorted by expert, here or, with ``ep_group``, on the ranks
    holding them (``exchange_rows``)."""
    order = chosen.flatten().argsort(stable=True)  # rows by expert, tokens in order
    token = order // chosen.shape[1]
    routed = tokens[token]
    if ep_group is None:
        out = experts(routed, counts.tolist())
    else:
        out = exchange_rows(experts, routed, counts, ep_group)
    # rows come sorted by expert, so each token sums its experts in their order
    return torch.zeros_like(tokens).index_add(0, token, out * weights.flatten()[order, None])


def exchange_rows(experts, routed: torch.Tensor, counts: torch.Tensor,
                  group: dist.ProcessGroup) -> torch.Tensor:
    """Expert parallelism: send each row of ``routed`` (sorted by expert; ``counts`` rows
    per expert, over all experts) to the rank of ``group`` holding its expert (rank ``r``
    holds experts ``r * local`` to ``(r + 1) * local - 1``), run ``experts(rows, counts)``
    there on the rows every rank sent, and bring the results back in ``routed``'s order.
    Both exchanges are differentiable all-to-alls, so backward sends the gradients the
    same way."""
    ranks = dist.get_world_size(group)
    local = counts.numel() // ranks
    received = torch.empty_like(counts)  # rows this rank gets from each peer per expert
    dist.all_to_all_single(received, counts, group=group)
    # one read of both counts on the host (each read waits for the device); the sizes
    # below are sums of them, in Python
    sent, got = torch.stack([counts.view(ranks, local), received.view(ranks, local)]).tolist()
    send, recv = [sum(row) for row in sent], [sum(row) for row in got]
    arrived = funcol.all_to_all_single_autograd(routed, recv, send, group)
    # arrived rows are (peer, expert)-major; the experts want (expert, peer)-major
    pieces = arrived.split([n for row in got for n in row])
    by_expert = [pieces[p * local + e] for e in range(local) for p in range(ranks)]
    out = experts(torch.cat(by_expert), [sum(row[e] for row in got) for e in range(local)])
    back = out.split([got[p][e] for e in range(local) for p in range(ranks)])
    by_peer = torch.cat([back[e * ranks + p] for p in range(ranks) for e in range(local)])
    return funcol.all_to_all_single_autograd(by_peer, send, recv, group)


def split_experts(model: nn.Module, ep_mesh) -> None:
    """Expert parallelism: keep on each rank of the 1-D ``ep_mesh`` only its
    ``n_experts / ep`` experts of every ``MoE`` in ``model``; their weights become DTensors
    ``Shard(0)`` on ``ep_mesh``, each rank's part cut from its own copy (the others may
    hold theirs on the meta device). Apply before ``fully_shard``."""
    ep = ep_mesh.size()
    for name, moe in model.named_modules():
        if not isinstance(moe, MoE):
            continue
        if not isinstance(moe.experts, GroupedExperts):
            raise ValueError(f"split_experts: {name}'s experts are a ModuleList; build the "
                             "model with GPTConfig(grouped_experts=True) to split them.")
        if moe.n_experts % ep:
            raise ValueError(f"split_experts: {name}'s {moe.n_experts} experts do not split "
                             f"over {ep} expert-parallel ranks.")
        for linear in (moe.experts.fc, moe.experts.proj):
            for attr in ("weight", "bias"):
                split_rows(linear, attr, ep_mesh)
        moe.ep_group = ep_mesh.get_group()


def split_rows(module: nn.Module, name: str, ep_mesh) -> None:
    """Replace ``module``'s parameter ``name`` by this rank's rows of it: a DTensor
    ``Shard(0)`` on the 1-D ``ep_mesh``, cut from this rank's own copy (no collective, so
    the copy may be on the meta device)."""
    full = getattr(module, name).detach()
    mine = full.chunk(ep_mesh.size())[ep_mesh.get_local_rank()].clone()
    setattr(module, name, nn.Parameter(DTensor.from_local(
        mine, ep_mesh, [Shard(0)], run_check=False, shape=full.shape, stride=full.stride())))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MoE(cfg) if cfg.n_experts else MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        if not self.tok_emb.weight.is_meta:
            self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """GPT-2 style init; call after ``to_empty`` when the model was built on meta."""
        std = 0.02
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            elif ".ln" in name or name.startswith("ln_f"):
                p.fill_(1.0)
            elif name.endswith("proj.weight"):  # residual projections, scaled by depth
                p.normal_(0.0, std / math.sqrt(2 * self.cfg.n_layers))
            else:
                p.normal_(0.0, std)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        pos = torch.arange(t, device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.ln_f(x))


# The model shape of each of the trainer's presets (``fullshard train --preset NAME``), by
# name: what ``fullshard.memory.estimate`` sizes for a preset name. The presets' other
# settings, and why each is this size, are in fullshard/train/config/schema.py.
SHAKESPEARE_VOCAB = 65  # distinct characters in the shipped tinyshakespeare.txt

PRESET_SHAPES: dict[str, GPTConfig] = {
    "debug": GPTConfig(vocab_size=SHAKESPEARE_VOCAB, seq_len=32, d_model=32, n_layers=2,
                       n_heads=2),
    "shakespeare": GPTConfig(vocab_size=SHAKESPEARE_VOCAB, seq_len=128, d_model=256,
                             n_layers=4, n_heads=4),
    "moe": GPTConfig(vocab_size=SHAKESPEARE_VOCAB, seq_len=64, d_model=128, n_layers=4,
                     n_heads=4, mlp_ratio=2, n_experts=8, top_k=2, grouped_experts=True),
    "gpt2-124m": GPTConfig(vocab_size=50257, seq_len=1024, d_model=768, n_layers=12,
                           n_heads=12),
    "llama-1b": GPTConfig(vocab_size=128256, seq_len=2048, d_model=2048, n_layers=16,
                          n_heads=32),
}


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def aux_loss(model: nn.Module) -> torch.Tensor | None:
    """The weighted load-balancing loss of ``model``'s last forward (mixture-of-experts
    blocks), or None for a dense model."""
    losses = [m.aux_loss for m in model.modules()
              if isinstance(m, MoE) and m.aux_loss is not None]
    if not losses:
        return None
    coef = next(m for m in model.modules() if isinstance(m, GPT)).cfg.aux_loss_coef
    return coef * torch.stack(losses).sum()


def gpt_loss(model: nn.Module, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy of ``model(idx)``, plus the load-balancing loss when the
    blocks are mixtures of experts."""
    loss = lm_loss(model(idx), targets)
    aux = aux_loss(model)
    return loss if aux is None else loss + aux
