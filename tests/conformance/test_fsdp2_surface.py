"""fullshard's FSDP2 surface is torch's: every public name, method and parameter name.

Read from the installed torch, so a torch upgrade that adds a name fails here first.
"""

from __future__ import annotations

import dataclasses
import inspect

import torch.distributed.checkpoint.state_dict as torch_dsd
import torch.distributed.fsdp as torch_fsdp

import fullshard
from fullshard import checkpoint as ckpt
from fullshard.torch_version import VERSION

FSDP2_NAMES = ["fully_shard", "FSDPModule", "UnshardHandle", "register_fsdp_forward_method",
               "MixedPrecisionPolicy", "OffloadPolicy", "CPUOffloadPolicy", "share_comm_ctx",
               "DataParallelMeshDims", "GradientReductionHandle"]
# What torch 2.15 added: fullshard has it on every supported torch (Note [torch versions]).
ADDED_IN_2_15 = ["set_keep_unsharded_storage", "set_manual_backward_finalization",
                 "finalize_backward"]


def _parameters(fn) -> list[str]:
    return list(inspect.signature(fn).parameters)


def test_every_fsdp2_name_of_the_installed_torch_exists():
    present = [n for n in FSDP2_NAMES if hasattr(torch_fsdp, n)]
    missing = [n for n in present if not hasattr(fullshard, n)]
    assert not missing, missing


def test_every_public_fsdpmodule_method_of_torch_exists_with_its_parameters():
    torch_methods = {m for m in dir(torch_fsdp.FSDPModule) if not m.startswith("_")}
    missing = sorted(m for m in torch_methods if not hasattr(fullshard.FSDPModule, m))
    assert not missing, missing
    differ = {m: (_parameters(getattr(torch_fsdp.FSDPModule, m)),
                  _parameters(getattr(fullshard.FSDPModule, m)))
              for m in torch_methods
              if _parameters(getattr(torch_fsdp.FSDPModule, m))
              != _parameters(getattr(fullshard.FSDPModule, m))}
    assert not differ, differ


def test_fully_shard_takes_torchs_parameters_with_torchs_defaults():
    theirs = inspect.signature(torch_fsdp.fully_shard).parameters
    ours = inspect.signature(fullshard.fully_shard).parameters
    assert [n for n in ours if n in theirs] == list(theirs)
    # fullshard's own flag, and on torch 2.11 the parameter torch 2.13 added
    newer = set() if VERSION >= (2, 13) else {"dp_mesh_dims"}
    assert set(ours) - set(theirs) == {"debug"} | newer
    for name, p in theirs.items():
        if p.default is not inspect.Parameter.empty and dataclasses.is_dataclass(p.default):
            # a policy: torch's fields with torch's defaults (fullshard's may have the
            # fields a newer torch added)
            for f in dataclasses.fields(p.default):
                assert getattr(ours[name].default, f.name) == getattr(p.default, f.name), \
                    (name, f.name)
        elif p.default is not inspect.Parameter.empty:
            assert repr(ours[name].default) == repr(p.default), name


def test_torch_2_15_names_exist_on_every_supported_torch():
    for method in ADDED_IN_2_15:
        assert callable(getattr(fullshard.FSDPModule, method)), method
    assert hasattr(fullshard, "GradientReductionHandle")
    fields = {f.name for f in dataclasses.fields(fullshard.MixedPrecisionPolicy)}
    theirs = {f.name for f in dataclasses.fields(torch_fsdp.MixedPrecisionPolicy)}
    assert theirs <= fields and "param_dtype_override_fn" in fields


def test_state_dict_functions_take_torchs_parameter_names():
    for name in ["get_model_state_dict", "set_model_state_dict", "get_optimizer_state_dict",
                 "set_optimizer_state_dict", "get_state_dict", "set_state_dict"]:
        assert _parameters(getattr(ckpt, name)) == _parameters(getattr(torch_dsd, name)), name
