"""Check that a state dict fits a module before ``load_state_dict`` copies anything.

``nn.Module.load_state_dict`` copies every entry that fits and raises at the end for
those that do not, so a mismatched checkpoint leaves a half-loaded model behind.
``FSDPModule.load_state_dict`` calls :func:`check_fits` first, so that a missing key
(under ``strict``) or a shape mismatch raises naming the key while the model is still
untouched.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor


def own_hook(hook: Callable) -> Callable:
    """Mark one of fullshard's own load pre-hooks: they rename no key."""
    hook._fullshard_own = True
    return hook


def _loads_itself(module: nn.Module) -> bool:
    """An overridden ``_load_from_state_dict``, or a load pre-hook not fullshard's."""
    return (type(module)._load_from_state_dict is not nn.Module._load_from_state_dict
            or any(not getattr(getattr(h, "hook", h), "_fullshard_own", False)
                   for h in module._load_state_dict_pre_hooks.values()))


def _entries(module: nn.Module, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(key, tensor) for every parameter and persistent buffer ``load_state_dict`` will
    look for under ``prefix``. Modules that load themselves (an overridden
    ``_load_from_state_dict``, or load pre-hooks of their own) are left to that code, with
    everything under them: a pre-hook may rename the keys of the whole subtree, as
    torch's ``checkpoint_wrapper`` adds ``_checkpoint_wrapped_module.`` to those that
    torch's ``set_model_state_dict`` hands over without it."""
    if _loads_itself(module):
        return
    for name, p in module._parameters.items():
        if p is not None:
            yield prefix + name, p
    for name, b in module._buffers.items():
        if b is not None and name not in module._non_persistent_buffers_set:
            yield prefix + name, b
    for name, child in module._modules.items():
        if child is not None:
            yield from _entries(child, f"{prefix}{name}.")


def check_fits(module: nn.Module, state_dict: dict[str, Any], prefix: str, strict: bool,
               label: str) -> None:
    """Raise naming every key of ``module``'s subtree that is missing (under ``strict``)
    or has another shape in ``state_dict``; nothing has been loaded at that point."""
    problems, plain = [], []
    for key, tensor in _entries(module, prefix):
        value = state_dict.get(key)
        if value is None:
            if strict and key not in state_dict:
                problems.append(f"'{key}' is missing")
            continue
        if isinstance(value, torch.Tensor) and tuple(value.shape) != tuple(tensor.shape):
            problems.append(f"'{key}' has shape {tuple(value.shape)} in the state dict but "
                            f"{tuple(tensor.shape)} in the model")
        elif isinstance(tensor, DTensor) and isinstance(value, torch.Tensor) \
                and not isinstance(value, DTensor):
            plain.append(key)
    if plain and not problems:
        more = f" (and {len(plain) - 1} more)" if len(plain) > 1 else ""
        raise RuntimeError(
            f"load_state_dict({label}): '{plain[0]}'{more} is a plain tensor in the state "
            "dict, but a sharded DTensor in the model. Nothing was loaded. Load a full "
            "(unsharded) state dict with fullshard.checkpoint.set_model_state_dict(model, "
            "state_dict, options=StateDictOptions(full_state_dict=True)), which keeps each "
            "rank's rows; a sharded model's own state_dict() loads here as it is.")
    if problems:
        shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more"
                                            if len(problems) > 5 else "")
        raise RuntimeError(
            f"load_state_dict({label}): {shown}. Nothing was loaded. Load a state dict saved "
            "from a model of this configuration (strict=False skips missing keys).")
