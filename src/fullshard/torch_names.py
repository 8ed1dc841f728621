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
import sys
import warnings

# The modules callers import FSDP2's names from, and the one they are defined in (torch's
# own tests import FSDPModule from there).
TORCH_MODULES = ("torch.distributed.fsdp", "torch.distributed.fsdp._fully_shard",
                 "torch.distributed.fsdp._fully_shard._fully_shard",
                 "torch.distributed._composable.fsdp",
                 "torch.distributed._composable.fsdp.fully_shard")
NAMES = ("fully_shard", "FSDPModule", "UnshardHandle", "register_fsdp_forward_method",
         "share_comm_ctx", "GradientReductionHandle")

# Names left to torch where they are defined: torch's own fully_shard looks itself up
# there (``fully_shard.state(module)``), so a torch fully_shard bound before install()
# keeps working on the models it shards.
KEPT = {("torch.distributed.fsdp._fully_shard._fully_shard", "fully_shard")}

# How torch's fully_shard finds the modules it will manage, and the modules that call it
# by that name (which one calls it differs between torch versions): while installed, a
# guard there refuses a model with fullshard units in it (a torch fully_shard bound
# before install() meeting fullshard's; see core/refusals/torch_fsdp.py).
GUARDED = "_get_managed_modules"
GUARDED_IN = ("torch.distributed.fsdp._fully_shard._fsdp_init",
              "torch.distributed.fsdp._fully_shard._fully_shard")

# (module, name) -> torch's object, while installed: restoring needs them, and only an
# install can fill it, so it is process-wide like the patched modules themselves.
_SAVED: dict[tuple[str, str], object] = {}


class InstallOrderWarning(UserWarning):
    """``install()`` ran after some module had bound torch's FSDP2 names."""


def _ours() -> dict[str, object]:
    from . import api, fsdp_module

    return {"fully_shard": api.fully_shard, "FSDPModule": fsdp_module.FSDPModule,
            "UnshardHandle": fsdp_module.UnshardHandle,
            "register_fsdp_forward_method": api.register_fsdp_forward_method,
            "share_comm_ctx": api.share_comm_ctx,
            "GradientReductionHandle": fsdp_module.GradientReductionHandle}


def install() -> None:
    """Make ``torch.distributed.fsdp`` (and ``torch.distributed._composable.fsdp``) hand
    out fullshard's FSDP2 names. Idempotent."""
    ours = _ours()
    for module_name in TORCH_MODULES:
        module = importlib.import_module(module_name)
        for name in NAMES:
            if not hasattr(module, name):
                continue  # an older torch without it (GradientReductionHandle before 2.15)
            if (module_name, name) in KEPT:
                continue
            _SAVED.setdefault((module_name, name), getattr(module, name))
            setattr(module, name, ours[name])
    _guard_torch_fully_shard()
    _warn_about_earlier_bindings()


def _guard_torch_fully_shard() -> None:
    for module_name in GUARDED_IN:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        if not hasattr(module, GUARDED):
            continue  # another torch's layout: torch's own error stands
        original = _SAVED.setdefault((module_name, GUARDED), getattr(module, GUARDED))
        setattr(module, GUARDED, _guarded(original))


def _guarded(original):
    def managed_modules(root_modules, *args, **kwargs):
        for root in root_modules:
            _refuse_fullshard_units(root)
        return original(root_modules, *args, **kwargs)
    return managed_modules


def _refuse_fullshard_units(root) -> None:
    from .core.state import unit_of
    from .core.refusals.torch_fsdp import ORDER_HINT

    for sub_name, sub in root.named_modules():
        if unit_of(sub) is not None:
            where = f"submodule '{sub_name}'" if sub_name else "this module"
            raise ValueError(
                f"torch's fully_shard({type(root).__name__}): {where} is sharded by "
                "fullshard's fully_shard, not torch's; the two cannot shard parts of one "
                f"model. {ORDER_HINT}")


def _warn_about_earlier_bindings() -> None:
    """Name the modules (not torch's or fullshard's) that bound torch's ``fully_shard``
    or ``FSDPModule`` before this install: their calls keep torch's FSDP2."""
    originals = {id(obj): name for (module_name, name), obj in _SAVED.items()
                 if module_name == TORCH_MODULES[0] and name in ("fully_shard", "FSDPModule")}
    found = []
    for module_name, module in list(sys.modules.items()):
        if module is None or module_name.split(".")[0] in ("torch", "fullshard"):
            continue
        try:
            bound = list(vars(module).items())
        except TypeError:
            continue
        found += [f"{module_name}.{var} (torch's {originals[id(v)]})" for var, v in bound
                  if id(v) in originals]
    if found:
        shown = ", ".join(found[:3]) + (f" and {len(found) - 3} more" if len(found) > 3 else "")
        warnings.warn(
            f"fullshard.install(): {shown} was bound before install() ran; calls through it "
            "still use torch's FSDP2, which cannot share a model with fullshard. Call "
            "install() before importing what binds it, or run the program under "
            "python -m fullshard.run.", InstallOrderWarning, stacklevel=3)


def uninstall() -> None:
    """Give torch its own names back."""
    for (module_name, name), original in list(_SAVED.items()):
        setattr(importlib.import_module(module_name), name, original)
    _SAVED.clear()


def installed() -> bool:
    return bool(_SAVED)
