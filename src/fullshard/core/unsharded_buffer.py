"""UnshardedBuffer: a unit's gathered parameters, param-major, in one tensor.

The unsharded parameters are persistent views into it (Note [unsharded params are
persistent views] in core/param.py); its storage is freed (resized to 0) while the unit
is sharded and allocated again before each gather's copy-out, so the views keep their
addresses without holding memory. With a shard group of one rank and nothing to cast or
copy it is the flat shard itself (Note [shard groups of one rank] in core/group.py).
"""

from __future__ import annotations

import torch

from .shard_storage import ShardStorage


class UnshardedBuffer:
    """The gathered parameters of one unit's plain (flat-buffer) parameters."""

    def __init__(self, storage: ShardStorage, world_size: int):
        self.storage = storage
        self.world_size = world_size
        self.tensor: torch.Tensor | None = None
        self.writer: torch.Tensor | None = None  # ``tensor.data``: its own version counter
        self._targets: list[torch.Tensor] = []   # per parameter: world x its shard, param-major
        # set_keep_unsharded_storage(True): reshard keeps the gathered storage allocated,
        # so the unsharded parameters keep their addresses (CUDA graphs), at its memory
        self.keep_storage = False
        # Note [shards on another dim]: those copy out one parameter at a time
        self._dim0_only = all(p.layout.dim == 0 for p in storage.params)

    @property
    def built(self) -> bool:
        return self.tensor is not None

    def build(self, aliases_shard: bool, dtype: torch.dtype, device: torch.device) -> None:
        """Allocate the buffer and make each parameter's persistent unsharded view (once;
        again after ``forget``), with the storage freed until the first gather."""
        w, sizes = self.world_size, self.storage.sizes
        self.tensor = self.storage.tensor if aliases_shard else torch.empty(
            w * self.storage.numel, dtype=dtype, device=device)
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

    @property
    def is_shard(self) -> bool:
        """Whether the buffer is the flat shard itself (nothing gathered or freed)."""
        return self.tensor is self.storage.tensor

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
