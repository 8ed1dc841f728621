"""``FSDP.summon_full_params``: the whole parameters, readable and writable, for a while.

Each DTensor parameter under the module is gathered into a plain full tensor and
registered in its place (tied parameters stay one object); on exit the DTensors come
back, after writing each rank's rows of the (possibly modified) full values into its
shard when ``writeback`` is set. Values are in the parameters' own dtype (full
precision under mixed precision).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ..fsdp_module import FSDPModule
from ..core.init import managed_modules
from .state_dict import local_shard


def _sharded_slots(module: nn.Module, recurse: bool) -> list[tuple[nn.Module, str, DTensor]]:
    modules = module.modules() if recurse else (m for _, m in managed_modules(module))
    slots = []
    for m in modules:
        root = m._unit.root if isinstance(m, FSDPModule) else None
        if root is not None and root.backward.running:
            raise RuntimeError("summon_full_params cannot be used during backward.")
        for name, p in m._parameters.items():
            if isinstance(p, DTensor):
                slots.append((m, name, p))
    return slots


@contextlib.contextmanager
def summon_full_params(module: nn.Module, recurse: bool = True, writeback: bool = True,
                       rank0_only: bool = False, offload_to_cpu: bool = False,
                       with_grads: bool = False):
    if rank0_only and writeback:
        raise ValueError("summon_full_params: writeback=True with rank0_only=True is not "
                         "supported (other ranks would have nothing to write back); pass "
                         "writeback=False.")
    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.reshard()
    slots = _sharded_slots(module, recurse)
    keep = not rank0_only or dist.get_rank() == 0
    full: dict[int, nn.Parameter] = {}
    with torch.no_grad():
        for _, _, p in slots:
            if id(p) in full:
                continue
            value = p.full_tensor()
            grad = p.grad.full_tensor() if with_grads and p.grad is not None else None
            if offload_to_cpu:
                value = value.cpu()
                grad = grad.cpu() if grad is not None else None
            param = nn.Parameter(value, requires_grad=p.requires_grad)
            param.grad = grad
            full[id(p)] = param
    try:
        if keep:
            for m, name, p in slots:
                m._parameters[name] = full[id(p)]
        yield
    finally:
        if keep:
            for m, name, p in slots:
                m._parameters[name] = p
        if writeback:
            with torch.no_grad():
                for key, p in {id(p): p for _, _, p in slots}.items():
                    _write_back(p, full[key])


def _write_back(sharded: DTensor, full: torch.Tensor) -> None:
    """Copy this rank's rows of ``full`` into ``sharded``'s local tensor (no communication)."""
    sharded.to_local().copy_(local_shard(full, sharded).to_local())
