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
