"""A parameter shared by two units (one ``fully_shard`` call each) is refused with
torch's exception type and torch's words first, so code matching torch's error also
matches fullshard's (docs/errors.md E06). fullshard refuses at the second
``fully_shard`` call, torch at the first forward (docs/conformance.md)."""

from __future__ import annotations

import re

import pytest
import torch.nn as nn

from fullshard import fully_shard
from fullshard.testing.threaded_world import run_threaded

TORCHS_PATTERN = "already managed by another"  # what torch's own test matches


class _Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(11, 4)
        self.head = nn.Linear(4, 11, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        return self.head(self.embed(ids))


def _shard_tied_apart() -> tuple[str, str]:
    """(the call that raised, its message)."""
    model = _Tied()
    fully_shard(model.embed)
    stage = "fully_shard(head)"
    try:
        fully_shard(model.head)
        stage = "fully_shard(root)"
        fully_shard(model)
        stage = "forward"
        model.head(model.embed.weight.new_zeros(1, 4))
    except ValueError as err:
        return stage, str(err)
    return stage, ""


@pytest.mark.slow
def test_a_parameter_shared_by_two_units_is_refused_in_torchs_words():
    stage, message = run_threaded(_shard_tied_apart, 2)[0]
    assert re.search(TORCHS_PATTERN, message), message
    assert message.startswith("Parameter 'weight' is shared with a parameter already managed")
    assert "fully_shard([module_a, module_b])" in message
    assert "apply fully_shard to their common parent" in message  # fullshard's guidance follows
    # earlier than torch, which refuses at the first forward: a deliberate difference
    # (docs/conformance.md), the refusal names the call that made the second unit
    assert stage == "fully_shard(head)", stage
