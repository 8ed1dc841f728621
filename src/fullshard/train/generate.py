"""The text sample printed at the end of a run.

A sharded model's forward is collective (each unit all-gathers its parameters), so
every rank runs the same generation with the same seeded generator and reaches the
same tokens; rank 0 prints them.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn


@torch.no_grad()
def sample(model: nn.Module, logits: Callable[[torch.Tensor], torch.Tensor],
           prompt: list[int], new_tokens: int, context: int, temperature: float,
           seed: int, device: torch.device) -> list[int]:
    """``new_tokens`` ids continuing ``prompt``: at temperature 0 the most likely id,
    else drawn from the softmax at ``temperature``; the model sees the last ``context``
    ids (no key/value cache: the sample is short)."""
    was_training = model.training
    model.eval()
    generator = torch.Generator().manual_seed(seed)
    ids = torch.tensor([prompt], dtype=torch.long, device=device)
    for _ in range(new_tokens):
        last = logits(ids[:, -context:])[0, -1].float().cpu()
        if temperature == 0:
            choice = last.argmax().view(1)
        else:
            probs = torch.softmax(last / temperature, dim=-1)
            choice = torch.multinomial(probs, 1, generator=generator)
        ids = torch.cat([ids, choice.to(device).view(1, 1)], dim=1)
    model.train(was_training)
    return ids[0, len(prompt):].tolist()
