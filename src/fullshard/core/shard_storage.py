"""ShardStorage: the one buffer that holds a unit's shards on this rank, and where it lives.

A unit's parameters share one flat shard (Note [one storage is the shard] in
core/param.py): this rank's padded shards, parameter after parameter, whose views are
the local tensors of the DTensor parameters, so the optimizer updates it in place and the
all-gather sends it as is. Where that buffer lives follows the unit's offload policy: on
the compute device, in host memory (pinned when computing on CUDA, Note [CPU offload] in
core/group.py) or in a file mapping (Note [parameters on disk] in core/mapped.py).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

from .mapped import mapped_empty, page_out
from .param import ShardedParam
from .schedule import shard_device_for

if TYPE_CHECKING:
    from ..policies import CPUOffloadPolicy


class ShardStorage:
    """The flat shard of one unit's parameters that gather as plain tensors."""

    def __init__(self, params: list[ShardedParam], unit_name: str,
                 offload: "CPUOffloadPolicy | None", compute_device: torch.device | None):
        self.params = params
        self.unit_name = unit_name
        self.offload = offload
        self.sizes = [p.layout.shard_numel for p in params]
        self.numel = sum(self.sizes)
        self.tensor: torch.Tensor | None = None
        self._compute_device = compute_device

    @property
    def compute_device(self) -> torch.device:
        """Where the unit's gathered parameters live and its forward and backward run."""
        if self.offload is not None or self.tensor is None:
            return self._compute_device
        return self.tensor.device

    def device_for(self, device: torch.device) -> torch.device:
        """Where the flat shard lives when parameters are computed on ``device``."""
        return shard_device_for(self.offload is not None, device)

    @property
    def on_disk(self) -> bool:
        """Whether the flat shard is a file mapping (Note [parameters on disk])."""
        return getattr(self.offload, "params", False)

    def fill(self, full: dict[ShardedParam, torch.Tensor], requires_grad: dict,
             dtype: torch.dtype, device: torch.device) -> None:
        """Allocate the flat shard for computing on ``device`` and copy each parameter's
        rows of ``full`` into it (on the meta device when any is meta)."""
        self._compute_device = device
        if any(full[p].is_meta for p in self.params):
            self.tensor = torch.empty(self.numel, dtype=dtype, device="meta")
        else:
            self.tensor = self._new(dtype, self.device_for(device))
        for p, view in zip(self.params, self.views()):
            p.shard_from(full[p], view, requires_grad=requires_grad[p])
        if self.on_disk and not self.tensor.is_meta:
            page_out(self.tensor)

    def _new(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if self.on_disk and device.type == "cpu":  # Note [parameters on disk]
            return mapped_empty(self.numel, dtype, os.fspath(self.offload.path),
                                self.unit_name)
        pin = (self.offload is not None and self.offload.pin_memory and device.type == "cpu"
               and self.compute_device.type == "cuda")
        return torch.empty(self.numel, dtype=dtype, device=device, pin_memory=pin)

    def views(self) -> list[torch.Tensor]:
        """Each parameter's padded shard, a view of the flat shard."""
        return list(torch.split(self.tensor, self.sizes))

    def readopt(self, local: torch.Tensor, copy_values: bool) -> bool:
        """Re-point every DTensor at the flat shard after a module ``_apply`` or an
        ``assign=True`` load replaced them with tensors like ``local``; reallocate when
        their device or dtype changed (copying their values over unless ``copy_values``
        is False: ``to_empty``). Whether the flat shard is a new tensor."""
        device = local.device if local.is_meta else self.device_for(local.device)
        if self.offload is None and not local.is_meta:
            self._compute_device = local.device  # .to()/.cuda() moved the module
        renewed = self.tensor is None or (self.tensor.device, self.tensor.dtype) != (
            device, local.dtype)
        if renewed:
            self.tensor = (torch.empty(self.numel, dtype=local.dtype, device=device)
                           if device.type == "meta" else self._new(local.dtype, device))
        for p, view in zip(self.params, self.views()):
            p.readopt(view, copy_values)
        return renewed
