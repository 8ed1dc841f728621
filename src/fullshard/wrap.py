"""Wrap policies: which submodules become units of their own.

The policies have the signature and semantics of ``torch.distributed.fsdp.wrap``:
``policy(module, recurse, nonwrapped_numel) -> bool`` is asked first with
``recurse=True`` (descend into this child?) and, after the children were handled,
with ``recurse=False`` (make this module a unit, given the parameters its wrapped
children did not take?). They work through ``functools.partial`` as in torch and
in the direct form ``transformer_auto_wrap_policy(transformer_layer_cls={Block})``.

``apply_wrap_policy`` applies a policy with ``fully_shard`` (children first, root
last); ``auto_wrap`` needs no policy: it shards the model's repeated blocks.
A module that shares a parameter with a module outside it (an input embedding tied
to the output head) is never made a unit of its own, whatever the policy says: a
parameter belongs to exactly one unit, so it stays with the enclosing unit that
holds both users.
"""

from __future__ import annotations

import functools
from collections import Counter
from typing import Any, Callable, Iterable

import torch.nn as nn

Policy = Callable[..., bool]


def _direct_form(policy: Callable, module: nn.Module | None, **kwargs: Any):
    """``policy(transformer_layer_cls=...)`` with no module returns the bound policy."""
    return functools.partial(policy, **kwargs) if module is None else None


def transformer_auto_wrap_policy(module: nn.Module | None = None, recurse: bool = False,
                                 nonwrapped_numel: int = 0, *,
                                 transformer_layer_cls: Iterable[type]) -> bool | Policy:
    """Wrap every instance of ``transformer_layer_cls`` (e.g. the decoder layer class)."""
    bound = _direct_form(transformer_auto_wrap_policy, module,
                         transformer_layer_cls=transformer_layer_cls)
    if bound is not None:
        return bound
    return True if recurse else isinstance(module, tuple(transformer_layer_cls))


def size_based_auto_wrap_policy(module: nn.Module | None = None, recurse: bool = False,
                                nonwrapped_numel: int = 0, *, min_num_params: int = int(1e8),
                                force_leaf_modules: set[type] | None = None,
                                exclude_wrap_modules: set[type] | None = None
                                ) -> bool | Policy:
    """Wrap a module once the parameters not yet taken by wrapped children reach
    ``min_num_params``; never descend into ``force_leaf_modules`` (default, as torch:
    MultiheadAttention) or wrap ``exclude_wrap_modules`` (default: ModuleList and
    ModuleDict, which have no forward)."""
    bound = _direct_form(size_based_auto_wrap_policy, module, min_num_params=min_num_params,
                         force_leaf_modules=force_leaf_modules,
                         exclude_wrap_modules=exclude_wrap_modules)
    if bound is not None:
        return bound
    leaf = tuple(force_leaf_modules if force_leaf_modules is not None
                 else {nn.MultiheadAttention})
    exclude = tuple(exclude_wrap_modules if exclude_wrap_modules is not None
                    else {nn.ModuleList, nn.ModuleDict})
    large = nonwrapped_numel >= min_num_params
    if recurse:  # a small subtree is never worth descending into
        return large and not isinstance(module, leaf)
    return large and not isinstance(module, exclude)


def lambda_auto_wrap_policy(module: nn.Module | None = None, recurse: bool = False,
                            nonwrapped_numel: int = 0, *,
                            lambda_fn: Callable[[nn.Module], bool]) -> bool | Policy:
    """Wrap the modules for which ``lambda_fn(module)`` is true."""
    bound = _direct_form(lambda_auto_wrap_policy, module, lambda_fn=lambda_fn)
    if bound is not None:
        return bound
    return True if recurse else bool(lambda_fn(module))


class ModuleWrapPolicy:
    """Wrap every instance of the given module classes."""

    def __init__(self, module_classes: Iterable[type]):
        self.module_classes = tuple(module_classes)

    def __call__(self, module: nn.Module, recurse: bool, nonwrapped_numel: int = 0) -> bool:
        return True if recurse else isinstance(module, self.module_classes)


def apply_wrap_policy(root: nn.Module, policy: Policy,
                      wrap: Callable[[nn.Module], Any]) -> list[nn.Module]:
    """Call ``wrap`` on every submodule the policy selects, children before parents, then
    on ``root``; return the wrapped submodules (root excluded)."""
    wrapped: list[nn.Module] = []
    seen: set[int] = set()
    registrations = _registrations(root)

    def visit(module: nn.Module) -> int:
        """Parameters under ``module`` that no wrapped descendant took."""
        own = sum(p.numel() for p in module.parameters(recurse=False) if id(p) not in seen)
        seen.update(id(p) for p in module.parameters(recurse=False))
        remaining = own
        for child in module.children():
            if policy(module=child, recurse=True, nonwrapped_numel=_numel(child, seen)):
                left = visit(child)
                if policy(module=child, recurse=False, nonwrapped_numel=left) \
                        and not _shares_params_outside(child, registrations):
                    wrap(child)
                    wrapped.append(child)
                    left = 0
                remaining += left
            else:
                remaining += _count_new(child, seen)
        return remaining

    visit(root)
    wrap(root)
    return wrapped


def _registrations(module: nn.Module) -> Counter:
    """How many (module, name) slots hold each parameter (by id) under ``module``."""
    return Counter(id(p) for m in module.modules() for p in m._parameters.values()
                   if p is not None)


def _shares_params_outside(module: nn.Module, everywhere: Counter) -> bool:
    inside = _registrations(module)
    return any(everywhere[key] > n for key, n in inside.items())


def _numel(module: nn.Module, seen: set[int]) -> int:
    return sum(p.numel() for p in module.parameters() if id(p) not in seen)


def _count_new(module: nn.Module, seen: set[int]) -> int:
    total = 0
    for p in module.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    return total


def repeated_block_classes(model: nn.Module) -> set[type]:
    """The classes to shard one unit each: Hugging Face's ``_no_split_modules`` when the
    model names them, else the outermost classes that repeat inside ModuleLists or
    Sequentials. A repeated class inside a repeated block (the experts of a mixture-of-
    experts block) stays in its block's unit: an expert that gets no token skips its
    forward, and a unit that runs on some ranks only cannot be gathered in step."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    if names:
        return {type(m) for m in model.modules() if type(m).__name__ in names}
    counts: Counter = Counter()
    for container in model.modules():
        if isinstance(container, (nn.ModuleList, nn.Sequential)):
            counts.update(type(child) for child in container)
    repeated = {cls for cls, n in counts.items() if n >= 2}
    nested = {type(inner) for outer in model.modules() if type(outer) in repeated
              for inner in outer.modules() if inner is not outer}
    return repeated - nested


def auto_wrap(model: nn.Module, unit_kwargs: Callable[[nn.Module], dict] | None = None,
              **fully_shard_kwargs: Any) -> nn.Module:
    """Shard ``model`` for the FSDP2 API without a policy: every repeated block (or Hugging
    Face ``_no_split_modules`` block) becomes a unit, then the root, which keeps its
    parameters from forward to backward (torch's default for a root) whatever
    ``reshard_after_forward`` the blocks get. ``unit_kwargs(module)`` overrides the
    arguments for one unit (e.g. an offload policy for some blocks only). Returns
    ``model``."""
    from .api import fully_shard

    classes = repeated_block_classes(model)
    if not classes:
        raise ValueError(
            f"auto_wrap: found no repeated blocks in {type(model).__name__} (no class repeats "
            "inside an nn.ModuleList/nn.Sequential and no _no_split_modules); shard its "
            "submodules with fully_shard yourself, or pass a policy to apply_wrap_policy.")
    root_kwargs = {**fully_shard_kwargs, "reshard_after_forward": None}  # the root keeps

    def shard(module: nn.Module) -> None:
        kwargs = root_kwargs if module is model else fully_shard_kwargs
        fully_shard(module, **kwargs, **(unit_kwargs(module) if unit_kwargs else {}))

    apply_wrap_policy(model, ModuleWrapPolicy(classes), shard)
    return model
