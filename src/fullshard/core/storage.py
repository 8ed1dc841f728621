"""A group's bytes on this rank: its flat shard (``ShardStorage``) and the buffer its
gathered parameters view (``UnshardedBuffer``).

A unit's parameters share one flat shard (Note [one storage is the shard] in
core/param.py): this rank's padded shards, parameter after parameter, whose views are
the local tensors of the DTensor parameters, so the optimizer updates it in place and the
all-gather sends it as is. Where that buffer lives follows the unit's offload policy: on
the compute device, in host memory (pinned when computing on CUDA, Note [CPU offload] in
core/group.py) or in a file mapping (Note [parameters on disk] in core/features/mapped.py).

The gathered parameters lie param-major in one tensor, which the unsharded parameters
are persistent views of (Note [unsharded params are persistent views] in
core/param.py); its storage is freed (resized to 0) while the unit is sharded and
allocated again before each gather's copy-out, so the views stay the same tensors
without holding memory (at the same addresses only where the allocator hands the bytes
back, or with ``set_keep_unsharded_storage``). With a shard group of one rank and
nothing to cast or copy it is the flat shard itself (Note [shard groups of one rank] in
core/group.py).

Note [parameters kept on the device]
``CPUOffloadPolicy(params_on_device=True)`` keeps the shard, gradients and optimizer states
on the host (the optimizer steps the host's shard) and, beside them, a copy of the shard on
the compute device in the dtype it is gathered in. A gather copies from that copy (device to
device) instead of from the host, and the copy itself is refreshed from the host only when
the shard was written since it was taken: an optimizer step, a load, any in-place write
through a parameter or a local tensor raises ``ShardStorage.written()``. With the shard
resharded after forward and gathered again in backward, and with several micro-batches, the
host-to-device traffic falls from one shard per gather to one per optimizer step, for the
shard's size in device memory (what DeepSpeed's ``offload_optimizer`` without
``offload_param`` keeps). A write through ``param.data`` makes a new tensor with a count of its
own and is not seen: the copy would stay stale, so the policy says so. A delayed update's
gathers read the copy taken before the step (Note [the delayed update]), not this one.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

from .features.mapped import mapped_empty, page_out
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
        # CPUOffloadPolicy(params_on_device=True): the shard as gathers read it, on the
        # compute device, and the write count it was copied at (Note [parameters kept on
        # the device])
        self.device_copy: torch.Tensor | None = None
        self._device_copy_written: int | None = None

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

    @property
    def dtype(self) -> torch.dtype:
        return self.tensor.dtype

    @property
    def device(self) -> torch.device:
        """Where the flat shard lives (the host under CPU offload)."""
        return self.tensor.device

    @property
    def pinned(self) -> bool:
        """Whether the flat shard is in pinned host memory (offloaded from CUDA)."""
        return self.tensor is not None and self.tensor.is_pinned()

    def offset_of(self, local: torch.Tensor) -> int:
        """Where ``local`` (a view of the flat shard) starts in it, in elements."""
        return local.storage_offset() - self.tensor.storage_offset()

    @property
    def keeps_device_copy(self) -> bool:
        """Whether gathers read a copy of the shard kept on the compute device (Note
        [parameters kept on the device])."""
        return getattr(self.offload, "params_on_device", False)

    def written(self) -> int:
        """A count every in-place write of the shard raises: the flat shard's version
        counter (fullshard's own writes) and each parameter's ``ShardedParam.written()``."""
        return self.tensor._version + sum(p.written() for p in self.params)

    def copy_into(self, dst: torch.Tensor) -> None:
        """Copy the flat shard into ``dst`` (casting, moving to its device), without
        blocking where the copy can run asynchronously; from the copy kept on the
        device where there is one."""
        if self.keeps_device_copy:
            dst.copy_(self._fresh_device_copy(dst.dtype, dst.device))
            return
        dst.copy_(self.tensor, non_blocking=True)
        if self.on_disk:  # a pageable source: copied once copy_ returns
            page_out(self.tensor)

    def _fresh_device_copy(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The copy kept on the device, copied from the shard again if the shard was
        written since (Note [parameters kept on the device])."""
        copy = self.device_copy
        if copy is None or (copy.dtype, copy.device) != (dtype, device):
            copy = self.device_copy = torch.empty(self.numel, dtype=dtype, device=device)
            self._device_copy_written = None
        written = self.written()
        if self._device_copy_written != written:
            copy.copy_(self.tensor, non_blocking=True)
            self._device_copy_written = written
        return copy

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
        self.device_copy = self._device_copy_written = None
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
        self.device_copy = self._device_copy_written = None  # new parameters: copied again
        return renewed


class UnshardedBuffer:
    """The gathered parameters of one unit's plain (flat-buffer) parameters."""

    def __init__(self, storage: ShardStorage, world_size: int):
        self.storage = storage
        self.world_size = world_size
        self.tensor: torch.Tensor | None = None
        # the parameters are views of the shard itself (Note [shard groups of one rank])
        self._aliased = False
        self.writer: torch.Tensor | None = None  # ``tensor.data``: its own version counter
        self._targets: list[torch.Tensor] = []   # per parameter: world x its shard, param-major
        # set_keep_unsharded_storage(True): reshard keeps the gathered storage allocated,
        # so the unsharded parameters keep their addresses (CUDA graphs), at its memory
        self.keep_storage = False
        # Note [shards on another dim]: those copy out one parameter at a time
        self._dim0_only = all(p.layout.dim == 0 for p in storage.params)

    @property
    def built(self) -> bool:
        return self.tensor is not None or self._aliased

    def build(self, aliases_shard: bool, dtype: torch.dtype, device: torch.device) -> None:
        """Allocate the buffer and make each parameter's persistent unsharded view (once;
        again after ``forget``), with the storage freed until the first gather. Aliasing
        the shard, the views are the shard's own: the storage's ``views()``, one flat
        shard's or, for a batch (core/batch.py), each member's."""
        if aliases_shard:
            self._aliased = True
            self.tensor = self.writer = self.storage.tensor  # None for a batch
            for p, view in zip(self.storage.params, self.storage.views()):
                p.make_unsharded(view)
            return
        w, sizes = self.world_size, self.storage.sizes
        self.tensor = torch.empty(w * self.storage.numel, dtype=dtype, device=device)
        # own version counter: see Note [unsharded params are persistent views]
        self.writer = self.tensor.data
        self._targets = [v.view(w, -1) for v in torch.split(self.writer, [w * n for n in sizes])]
        for p, view in zip(self.storage.params, torch.split(self.tensor, [w * n for n in sizes])):
            p.make_unsharded(view)
        self.free()

    def forget(self) -> None:
        """Drop the buffer: the flat shard was replaced, the next gather builds anew."""
        self.tensor = self.writer = None
        self._targets = []
        self._aliased = False

    @property
    def is_shard(self) -> bool:
        """Whether the parameters are views of the shard itself (nothing gathered or
        freed)."""
        return self._aliased

    def copy_out(self, rows: torch.Tensor) -> None:
        """Move the rank-major gathered shards (``rows``: world x shard) into the
        param-major buffer: one copy for dim-0 shards, a strided copy per parameter
        sharded on another dim (Note [shards on another dim])."""
        sizes = self.storage.sizes
        if self._dim0_only:
            torch.split_with_sizes_copy(rows, sizes, dim=1, out=self._targets)
            return
        for p, src, dst in zip(self.storage.params, torch.split(rows, sizes, dim=1),
                               self._targets):
            p.layout.copy_gathered(self.world_size, src, dst)

    def allocate(self) -> None:
        if self.is_shard:
            return
        storage = self.tensor.untyped_storage()
        nbytes = self.tensor.numel() * self.tensor.element_size()
        if storage.size() != nbytes:
            storage.resize_(nbytes)

    def free(self) -> None:
        if self.is_shard:
            return  # Note [shard groups of one rank]: the shard is the parameter
        if self.keep_storage:  # set_keep_unsharded_storage: addresses stay fixed
            return
        storage = self.tensor.untyped_storage()
        if storage.size() != 0:
            storage.resize_(0)
