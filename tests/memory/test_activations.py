"""The activation trace (memory/activations.py): a step traced on the meta device keeps
what fused attention keeps, not the attention matrix."""

import torch

from fullshard.gpt import GPT, GPTConfig, lm_loss
from fullshard.memory.activations import trace_step
from fullshard.memory.units import find_units


def test_trace_keeps_what_fused_attention_keeps():
    """Not the seq x seq attention matrix of SDPA's math path (meta's default)."""
    cfg = GPTConfig(vocab_size=64, seq_len=2048, d_model=64, n_layers=2, n_heads=4)
    with torch.device("meta"):
        model = GPT(cfg)
    tokens = torch.zeros(1, 2048, dtype=torch.long, device="meta")
    trace = trace_step(model, find_units(model), lambda m: lm_loss(m(tokens), tokens))
    attention_matrix = 4 * 2048 * 2048 * 4  # heads x seq x seq fp32, one layer
    assert 0 < trace.saved_at_forward_end < attention_matrix
    kinds = [e.kind for e in trace.events]
    assert kinds.count("pre_backward") == 3 and kinds[-1] == "backward_end"
