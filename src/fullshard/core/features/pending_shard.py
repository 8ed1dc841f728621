"""PendingShard: what a delayed unit's gathers read while its host step runs.

Under the delayed update (Note [the delayed update] in delayed_update.py) the host thread
writes a unit's flat shard while the next forward and backward gather that unit. The
gathers must not read a shard being written, nor wait for it: ``OverlappedStep.step()``
copies the flat shard here first (the parameters before the update it hands out), and
until the next ``step()`` every gather of the unit reads this copy instead. The host
thread never touches it, so gathers and the step share no memory.

The copy costs one host buffer the size of the flat shard per delayed unit (4 bytes a
parameter in fp32; pinned where the compute device is CUDA, so the copy-in to the device
stays asynchronous) and one host memcpy of it per step, made once and reused.
"""

from __future__ import annotations

import torch


class PendingShard:
    """The copy of one unit's flat shard that its gathers read while a delayed step of
    that unit runs on the host thread. ``pending``: whether gathers read it now."""

    def __init__(self):
        self.tensor: torch.Tensor | None = None
        self.pending = False

    def take(self, storage) -> None:
        """Copy the flat shard of ``storage`` (a ``ShardStorage``, or a batch's members'
        shards one after the other), before the update about to be handed out: gathers
        read the copy until ``drop``. Its version counter rises with each copy, which is
        what a gather notes (Note [parameters kept gathered across backward])."""
        if (self.tensor is None or self.tensor.numel() != storage.numel
                or self.tensor.dtype != storage.dtype or self.tensor.device != storage.device):
            pin = storage.device.type == "cpu" and storage.pinned
            self.tensor = torch.empty(storage.numel, dtype=storage.dtype, device=storage.device,
                                      pin_memory=pin)
        storage.copy_into(self.tensor)
        self.pending = True

    def drop(self) -> None:
        """Gathers read the flat shard again (an exact step, a load of the parameters)."""
        self.pending = False

    def view_of(self, local: torch.Tensor, storage) -> torch.Tensor:
        """The part of the copy that ``local`` (a view of the shard ``storage`` holds) is of
        that shard."""
        return self.tensor.as_strided(local.shape, local.stride(), storage.offset_of(local))
