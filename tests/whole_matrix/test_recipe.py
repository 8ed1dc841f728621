"""fullshard.whole_matrix.recipe: which parameters the Muon recipe gives Muon."""

import torch

from fullshard.gpt import GPT, GPTConfig
from fullshard.whole_matrix.recipe import muon_matrices

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
