"""A small mixture-of-experts model with expert parallelism, for tests of units on
different meshes (experts on their own mesh, dense layers on the data-parallel one).

``ExpertModel``'s blocks each hold a router and a bank of experts kept as 3-D weights
(``w1`` of shape ``(experts, hidden, dim)``, ``w2`` of ``(experts, dim, hidden)``, the
layout torchtitan's grouped experts use, so ``Shard(1)`` splits the hidden dimension),
between dense layers. Built without a process group it computes every expert itself: the
single-process reference. ``expert_parallel(model, ep_mesh)`` splits the experts across the ranks of
``ep_mesh`` (each weight becomes a DTensor ``Shard(0)`` on it, as torchtitan's expert
parallelism does): tokens travel to the rank owning their expert and back through
differentiable all-to-alls, so a rank's experts also compute, and get gradients from,
the tokens of the other ranks of its ``ep_mesh`` group.

Routing is top-k over a linear router; an expert no token chose does not run (its weights
get no gradient from that rank). ``counts`` records how many tokens each expert of this
rank's bank computed on in the last forward, so a test can show that one got none.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from ..gpt import mix_experts, split_rows, top_k_routing


class Experts(nn.Module):
    """``n`` two-layer expert MLPs as 3-D weights; ``forward(x, counts)`` runs expert
    ``e`` on the next ``counts[e]`` rows of ``x`` (rows sorted by expert)."""

    def __init__(self, n: int, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(n, hidden, dim) * dim ** -0.5)
        self.w2 = nn.Parameter(torch.randn(n, dim, hidden) * hidden ** -0.5)
        self.counts: list[int] = []

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        # expert parallel: the weights are DTensors on the expert mesh; this rank computes
        # with its own experts only (the local tensors), as torchtitan's experts do
        w1 = self.w1.to_local() if isinstance(self.w1, DTensor) else self.w1
        w2 = self.w2.to_local() if isinstance(self.w2, DTensor) else self.w2
        self.counts = list(counts)
        outs = [F.gelu(rows @ w1[e].T) @ w2[e].T
                for e, rows in enumerate(x.split(counts)) if counts[e]]
        # with no rows at all the output is still a function of ``x``: under expert
        # parallelism the all-to-all that brought ``x`` must run in backward on every rank
        return torch.cat(outs) if outs else x[:0]


class RoutedExperts(nn.Module):
    """Top-k routing over ``Experts``, with the all-to-alls of expert parallelism when
    ``ep_group`` is set."""

    def __init__(self, dim: int, hidden: int, n_experts: int, top_k: int):
        super().__init__()
        self.n_experts, self.top_k = n_experts, top_k
        self.router = nn.Linear(dim, n_experts, bias=False)
        self.experts = Experts(n_experts, dim, hidden)
        self.ep_group: dist.ProcessGroup | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        _, weights, chosen = top_k_routing(self.router, tokens, self.top_k)
        counts = torch.bincount(chosen.flatten(), minlength=self.n_experts)
        combined = mix_experts(self.experts, tokens, weights, chosen, counts, self.ep_group)
        return combined.view_as(x)


class ExpertBlock(nn.Module):
    """A residual block around routed experts (the router and norm are dense)."""

    def __init__(self, dim: int, hidden: int, n_experts: int, top_k: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.moe = RoutedExperts(dim, hidden, n_experts, top_k)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.moe(self.norm(h))


class ExpertModel(nn.Module):
    """A dense input layer, ``blocks`` blocks of routed experts, a dense head."""

    def __init__(self, dim: int = 8, hidden: int = 6, n_experts: int = 4, top_k: int = 2,
                 blocks: int = 2, d_in: int = 5, d_out: int = 3):
        super().__init__()
        self.inp = nn.Linear(d_in, dim)
        self.blocks = nn.ModuleList(ExpertBlock(dim, hidden, n_experts, top_k)
                                    for _ in range(blocks))
        self.head = nn.Linear(dim, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def expert_parallel(model: ExpertModel, ep_mesh: DeviceMesh) -> None:
    """Keep on each rank only its experts of ``model``: the expert weights become DTensors
    ``Shard(0)`` on ``ep_mesh`` (which must divide the expert count), and tokens travel
    to their expert's rank. Apply before ``fully_shard``."""
    for block in model.blocks:
        experts = block.moe.experts
        n = experts.w1.shape[0]
        if n % ep_mesh.size():
            raise ValueError(f"expert_parallel: {n} experts do not split over "
                             f"{ep_mesh.size()} expert-parallel ranks.")
        for name in ("w1", "w2"):
            split_rows(experts, name, ep_mesh)
        block.moe.ep_group = ep_mesh.get_group()
