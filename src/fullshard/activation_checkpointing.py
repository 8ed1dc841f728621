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
                                   check_fn: Callable[[nn.Module], bool] = lambda m: True, *,
                                   checkpoint_wrapper_fn: Callable | None = None,
                                   auto_wrap_policy: Callable | None = None
                                   ) -> list[nn.Module]:
    """Checkpoint each submodule of ``model`` selected by ``check_fn`` (or, as in torch, by
    ``auto_wrap_policy``); returns them. A selected module inside another selected one is
    left alone (its parent already recomputes it). ``checkpoint_wrapper_fn`` is accepted
    for torch compatibility when it is torch's non-reentrant ``checkpoint_wrapper``, which
    is what fullshard does in place."""
    _check_wrapper_fn(checkpoint_wrapper_fn)
    if auto_wrap_policy is not None:
        check_fn = functools.partial(_selected_by_policy, auto_wrap_policy)
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


def _selected_by_policy(policy: Callable, module: nn.Module) -> bool:
    numel = sum(p.numel() for p in module.parameters())
    return bool(policy(module=module, recurse=False, nonwrapped_numel=numel))


def _check_wrapper_fn(wrapper_fn: Callable | None) -> None:
    """Only torch's ``checkpoint_wrapper`` with non-reentrant checkpointing means what
    fullshard does; anything else would silently change meaning, so it raises."""
    if wrapper_fn is None:
        return
    func = getattr(wrapper_fn, "func", wrapper_fn)  # functools.partial(checkpoint_wrapper, ...)
    keywords = getattr(wrapper_fn, "keywords", {}) or {}
    impl = keywords.get("checkpoint_impl")
    if getattr(func, "__name__", "") != "checkpoint_wrapper" or set(keywords) - {"checkpoint_impl"}:
        raise ValueError(
            "apply_activation_checkpointing: checkpoint_wrapper_fn other than torch's "
            "checkpoint_wrapper is not supported; fullshard checkpoints the selected modules "
            "in place (non-reentrant, names unchanged). Drop checkpoint_wrapper_fn.")
    if impl is not None and getattr(impl, "name", str(impl)) != "NO_REENTRANT":
        raise ValueError(
            "apply_activation_checkpointing: reentrant checkpointing is not supported (it "
            "breaks gradient hooks sharding relies on); use CheckpointImpl.NO_REENTRANT or "
            "drop checkpoint_wrapper_fn.")


def _checkpointed(forward: Callable) -> Callable:
    @functools.wraps(forward)
    def run(*args, **kwargs):
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)
    run._fullshard_ac = True
    return run
