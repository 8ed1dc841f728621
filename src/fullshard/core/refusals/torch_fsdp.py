"""Modules that torch's own FSDP2 sharded, found before fullshard touches a model.

torch's ``fully_shard`` and fullshard's cannot share one model: each takes the other's
sharded parameters (DTensors) for tensor-parallel ones and fails deep inside. The usual
way to get there is import order: a ``from torch.distributed.fsdp import fully_shard``
that ran before ``fullshard.install()`` keeps torch's function, and code that then mixes
the two names shards parts of a model with each. fullshard refuses such a model by name
(here); torch's ``fully_shard`` meeting a fullshard unit is caught while ``install()``
is in effect (torch_names.py).
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed._composable.contract import _get_registry  # torch's composable APIs
# every module a composable API (torch's fully_shard among them) was applied to, weakly held
from torch.distributed._composable_state import _module_state_mapping

ORDER_HINT = ("A `from torch.distributed.fsdp import fully_shard` (or of FSDPModule) that "
              "ran before fullshard.install() keeps torch's: call install() before that "
              "import, or run the program under python -m fullshard.run, or shard every "
              "module of the model with one of the two.")


def sharded_by_torch(module: nn.Module) -> str | None:
    """The name of the first submodule of ``module`` (``''``: itself) that torch's FSDP2
    ``fully_shard`` was applied to, or None."""
    for name, sub in module.named_modules():
        registry = _get_registry(sub)
        if registry is not None and "fully_shard" in registry:
            return name
    return None


def refuse_torch_fsdp2(label: str, module: nn.Module) -> None:
    """Raise naming the part of ``module`` that torch's FSDP2 sharded, if any."""
    name = sharded_by_torch(module)
    if name is None:
        return
    where = f"submodule '{name}'" if name else "this module"
    raise ValueError(
        f"fully_shard({label}): {where} was sharded by torch's fully_shard "
        "(torch.distributed.fsdp), not fullshard's; the two cannot shard parts of one "
        f"model. {ORDER_HINT}")


def refuse_param_of_torch_fsdp2(label: str, fqn: str, p: nn.Parameter) -> None:
    """Raise if ``p`` is a parameter torch's FSDP2 already sharded through a module
    enclosing this one (torch's ``fully_shard`` on the root, then fullshard's on a child):
    ``refuse_torch_fsdp2`` looks only downwards, and the DTensor would otherwise be taken
    for a tensor-parallel parameter."""
    for owner in list(_module_state_mapping.keys()):
        registry = _get_registry(owner)
        if registry is None or "fully_shard" not in registry:
            continue
        if any(q is p for q in owner.parameters()):
            raise ValueError(
                f"fully_shard({label}): parameter '{fqn}' was already sharded by torch's "
                f"fully_shard (torch.distributed.fsdp) applied to {type(owner).__name__}, "
                "which encloses this module; the two cannot shard parts of one model. "
                f"{ORDER_HINT}")
