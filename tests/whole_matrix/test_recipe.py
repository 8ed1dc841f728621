"""fullshard.whole_matrix.recipe: which parameters the Muon recipe gives Muon."""

import torch

from fullshard.gpt import GPT, GPTConfig
from fullshard.whole_matrix.recipe import muon_matrices, owners_by_cost

CFG = dict(vocab_size=48, seq_len=8, d_model=32, n_layers=2, n_heads=2, n_experts=4, top_k=2)


def _names(model, params) -> set[str]:
    ids = {id(p) for p in params}
    return {n for n, p in model.named_parameters() if id(p) in ids}


def test_muon_takes_the_hidden_matrices_and_no_stacked_biases():
    with torch.device("meta"):
        listed = GPT(GPTConfig(**CFG))
        grouped = GPT(GPTConfig(**CFG, grouped_experts=True))
    chosen = _names(listed, muon_matrices(listed))
    assert "layers.0.mlp.experts.3.fc.weight" in chosen
    assert {"layers.0.attn.qkv.weight", "layers.1.mlp.router.weight"} <= chosen
    assert not {n for n in chosen if "bias" in n or "emb" in n or ".ln" in n}
    # stacked experts: the 2-D (experts, hidden) biases are vectors, not a matrix
    chosen = _names(grouped, muon_matrices(grouped))
    assert not {n for n in chosen if ".experts." in n}, chosen
    assert "layers.0.attn.qkv.weight" in chosen


def _owners_scanning_every_rank(costs: list[int], ranks: int) -> list[int]:
    load, owners = [0] * ranks, [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: -costs[i]):
        owner = min(range(ranks), key=lambda r: (load[r], r))
        load[owner] += costs[i]
        owners[i] = owner
    return owners


def test_owners_by_cost_places_as_the_greedy_scan_does():
    """The heap gives each matrix the rank a scan of every rank's load would: the least
    loaded, the lowest on ties (many equal costs, as a model's repeated layers have)."""
    gen = torch.Generator().manual_seed(0)
    for ranks in (1, 2, 3, 8, 64):
        for costs in (torch.randint(1, 50, (200,), generator=gen).tolist(), [7] * 100, []):
            assert owners_by_cost(costs, ranks) == _owners_scanning_every_rank(costs, ranks)
