"""GatherBatch: small units gathered and reduced by one collective each, while every
unit keeps its own ParamGroup and flat shard (Note [buckets: units gather together] in
core/buckets.py).

Note [a batch reads its members' shards]
A batch owns no shard: its members' flat shards stay what their DTensor parameters view
and what the optimizer updates (Note [one storage is the shard]). Its gather copies each
member's shard into this rank's chunk of one all-gather output, member after member (the
copy-in of Note [in-place all-gather], also without a cast), and gathers in place. The
output is then laid out rank by rank as [member 1's rank-r chunk, member 2's rank-r
chunk, ...]: as each member's shard is its parameters' padded shards in order, every
rank's chunk is the batch's parameters' shards in order, and one copy-out moves it into
the batch's unsharded buffer, which the members' unsharded parameters view. The
reduce-scatter packs the batch's gradients in the same layout; its output is the batch's
sharded gradient buffer, which each parameter's DTensor gradient views (Note [persistent
sharded gradients]). Against one merged flat shard the batch costs one copy of each
member's shard per gather (measured in docs/benchmarks.md), and nothing that holds a
parameter, its local tensor or a unit's group sees anything change at lazy init.

With one rank per shard group and nothing to cast (Note [shard groups of one rank]) the
batch's unsharded parameters are views of each member's own shard: there is nothing to
copy in or out.
"""

from __future__ import annotations

import torch

from .group import ParamGroup


class BatchShards:
    """The flat shards of a batch's members, read as one (the members keep them)."""

    # a batch has no flat tensor of its own: the gather copies each member's in
    tensor = None

    def __init__(self, members: list[ParamGroup]):
        self.parts = [m.storage for m in members]
        self.params = [p for part in self.parts for p in part.params]
        self.sizes = [n for part in self.parts for n in part.sizes]
        self.numel = sum(self.sizes)
        self.offload = self.parts[0].offload

    @property
    def compute_device(self) -> torch.device:
        return self.parts[0].compute_device

    @property
    def on_disk(self) -> bool:
        return self.parts[0].on_disk

    @property
    def dtype(self) -> torch.dtype:
        return self.parts[0].dtype

    @property
    def device(self) -> torch.device:
        return self.parts[0].device

    def written(self) -> int:
        """The sum of the members' write counts: any member's in-place write raises it."""
        return sum(part.written() for part in self.parts)

    @property
    def pinned(self) -> bool:
        return all(part.pinned for part in self.parts)

    def offset_of(self, local: torch.Tensor) -> int:
        """Where ``local`` (a view of one member's flat shard) starts in the members'
        shards read one after the other, in elements."""
        start = 0
        for part in self.parts:
            if part.tensor.untyped_storage().data_ptr() == local.untyped_storage().data_ptr():
                return start + part.offset_of(local)
            start += part.numel
        raise ValueError(f"{local.shape} is a view of no member's shard of this batch")

    def views(self) -> list[torch.Tensor]:
        """Each parameter's padded shard, a view of its member's flat shard."""
        return [view for part in self.parts for view in part.views()]

    def copy_into(self, dst: torch.Tensor) -> None:
        """Copy the members' shards into ``dst``, one after the other (the copy-in): one
        ``torch.cat`` where they are on ``dst``'s device (W2's batches of ~20 shards of
        25K floats: 36 us against 83 us for a copy each), else a copy each (host to
        device, asynchronous, under CPU offload; from each member's copy kept on the
        device where there is one)."""
        if not self.on_disk and self.device == dst.device and not self.parts[0].keeps_device_copy:
            torch.cat([part.tensor for part in self.parts], out=dst)  # casts into dst
            return
        offset = 0
        for part in self.parts:
            part.copy_into(dst.narrow(0, offset, part.numel))
            offset += part.numel


class GatherBatch(ParamGroup):
    """Adjacent small units' groups gathered by one all-gather and reduced by one
    reduce-scatter (Note [a batch reads its members' shards]). Each member group keeps
    its parameters and its shard; its ``batch`` is this batch, whose gathered buffer is
    its ``unsharded`` and whose transitions its own ``unshard``/``reshard`` run."""

    def __init__(self, members: list[ParamGroup], name: str):
        first = members[0]
        super().__init__([p for m in members for p in m.params], first.pg, name,
                         first.param_dtype, first.reduce_dtype, first.replicate_pg,
                         first.post_forward_size, offload=first.offload,
                         compute_device=first.compute_device, mp_policy=first.mp_policy,
                         storage=BatchShards(members))
        self.members = members
        self.unsharded.keep_storage = any(m.unsharded.keep_storage for m in members)
        self.quantize_weights, self.quantize_grads = first.quantize_weights, first.quantize_grads
        self.comm_options = first.comm_options  # core/comm_groups.py
        self.pool, self.copies = first.pool, first.copies
        for m in members:
            m.reshard()
            m.unsharded.forget()  # a gathered buffer of its own is never built again
            m.batch = self
            m.unsharded = self.unsharded

    def readopt(self, copy_values: bool = True) -> None:
        """Each member re-points its DTensors at its own flat shard."""
        for m in self.members:
            m.readopt(copy_values)
