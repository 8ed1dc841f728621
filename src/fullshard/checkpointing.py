"""Activation checkpointing that keeps parameter names unchanged.

``apply_activation_checkpointing(model, check_fn)`` makes every submodule for which
``check_fn(module)`` is true recompute its forward during backward instead of
keeping its activations (torch's non-reentrant ``torch.utils.checkpoint``). Unlike
torch's ``CheckpointWrapper`` it wraps the module's ``forward`` in place rather than
the module, so FQNs, state dicts and checkpoints are untouched, and it composes
with ``fully_shard`` in either order: the unit's parameters are gathered again by
its pre-backward hook before the recomputation reads them.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch.nn as nn
from torch.utils.checkpoint import checkpoint


def apply_activation_checkpointing(model: nn.Module,
                                   check_fn: Callable[[nn.Module], bool] = lambda m: True
                                   ) -> list[nn.Module]:
    """Checkpoint each submodule of ``model`` selected by ``check_fn``; returns them.
    A selected module inside another selected one is left alone (its parent already
    recomputes it)."""
    chosen: list[nn.Module] = []
    covered: set[int] = set()
    for module in model.modules():
        if id(module) in covered or not check_fn(module):
            continue
        if getattr(module.__dict__.get("forward"), "_fullshard_ac", False):
            raise ValueError(f"apply_activation_checkpointing: {type(module).__name__} is "
                             "already checkpointed.")
        module.__dict__["forward"] = _checkpointed(module.forward)
        chosen.append(module)
        covered.update(id(m) for m in module.modules())
    return chosen


def _checkpointed(forward: Callable) -> Callable:
    @functools.wraps(forward)
    def run(*args, **kwargs):
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)
    run._fullshard_ac = True
    return run
