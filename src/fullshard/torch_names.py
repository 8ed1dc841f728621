"""An explicit opt-in: make torch's FSDP2 names resolve to fullshard.

Code nobody here wrote (transformers' and accelerate's FSDP2 paths, Lightning's
``ModelParallelStrategy``, torchtitan) imports ``fully_shard`` and ``FSDPModule`` from
``torch.distributed.fsdp`` or ``torch.distributed._composable.fsdp``. After
:func:`install` those modules hand out fullshard's ``fully_shard``, ``FSDPModule``,
``UnshardHandle``, ``register_fsdp_forward_method`` and ``share_comm_ctx``, so such
code shards with fullshard unchanged and its ``isinstance(model, FSDPModule)`` checks
hold. torch's policy classes stay torch's (fullshard accepts them) and the FSDP1
wrapper stays torch's. Call it before importing the library that shards (a
``from torch.distributed.fsdp import fully_shard`` that already ran keeps torch's), or
run the program under ``python -m fullshard.run``. Nothing changes until it is called;
:func:`uninstall` restores torch's names.
"""

from __future__ import annotations

import importlib

# The modules callers import FSDP2's names from, and the one they are defined in (torch's
# own tests import FSDPModule from there).
TORCH_MODULES = ("torch.distributed.fsdp", "torch.distributed.fsdp._fully_shard",
                 "torch.distributed.fsdp._fully_shard._fully_shard",
                 "torch.distributed._composable.fsdp",
                 "torch.distributed._composable.fsdp.fully_shard")
NAMES = ("fully_shard", "FSDPModule", "UnshardHandle", "register_fsdp_forward_method",
         "share_comm_ctx", "GradientReductionHandle")

# (module, name) -> torch's object, while installed: restoring needs them, and only an
# install can fill it, so it is process-wide like the patched modules themselves.
_SAVED: dict[tuple[str, str], object] = {}


def _ours() -> dict[str, object]:
    from . import api, controls

    return {"fully_shard": api.fully_shard, "FSDPModule": api.FSDPModule,
            "UnshardHandle": api.UnshardHandle,
            "register_fsdp_forward_method": api.register_fsdp_forward_method,
            "share_comm_ctx": controls.share_comm_ctx,
            "GradientReductionHandle": controls.GradientReductionHandle}


def install() -> None:
    """Make ``torch.distributed.fsdp`` (and ``torch.distributed._composable.fsdp``) hand
    out fullshard's FSDP2 names. Idempotent."""
    ours = _ours()
    for module_name in TORCH_MODULES:
        module = importlib.import_module(module_name)
        for name in NAMES:
            if not hasattr(module, name):
                continue  # an older torch without it (GradientReductionHandle before 2.15)
            _SAVED.setdefault((module_name, name), getattr(module, name))
            setattr(module, name, ours[name])


def uninstall() -> None:
    """Give torch its own names back."""
    for (module_name, name), original in list(_SAVED.items()):
        setattr(importlib.import_module(module_name), name, original)
    _SAVED.clear()


def installed() -> bool:
    return bool(_SAVED)
