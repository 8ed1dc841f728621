"""How the replayed step runs: the settings core decides its buffers from, and each
group's state as the replay walks it (memory/replay.py, memory/reduction_replay.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.schedule import (copies_shard_in, frees_after_forward, gather_plan,
                             shard_device_for)
from .pinned import pinned_block_bytes
from .units import GroupLayout


@dataclass(frozen=True)
class RunSettings:
    """How fullshard runs the step, in the terms core decides its buffers from."""

    param_dtype: torch.dtype    # of shards, sharded gradients, optimizer states
    compute_dtype: torch.dtype  # of gathered parameters and unsharded gradients
    reduce_dtype: torch.dtype   # of the reduce-scatter buffers
    optimizer_states: int       # state tensors per parameter (AdamW: 2)
    foreach_optimizer: bool     # CUDA's default: one temporary the size of all shards
    device: torch.device        # where forward and backward run
    backend: str                # of the process groups ("gloo", "nccl")
    pool_max_numel: int         # BufferPool.max_numel (also the persistent-gradient limit)
    offload: bool               # shards, gradients, states on the host
    replicated: bool = False    # shard groups of one rank, replicas all-reduce (no_shard)
    heap_retention: bool = False  # CPU: freed small blocks stay resident (activations.py)
    keep_unsharded: bool = False  # set_keep_unsharded_storage (zero1): reshard keeps it
    states_on_disk: int = 0     # DiskOffloadPolicy: its chunk_numel (0: states in memory)
    params_on_disk: bool = False  # DiskOffloadPolicy(params=True): shards paged in per use
    # Muon's matrices (ParamShape keys): one state each, stepped whole on one rank; the
    # other parameters have ``optimizer_states`` (Note [whole-matrix optimizers])
    whole_matrix: frozenset[int] = frozenset()
    quantize_weights: int = 0   # set_quantized_communication: block size (0: off)
    quantize_grads: int = 0
    reduces_in_flight: int = 1  # set_reduce_scatter_max_input_buffers (Note [reductions in flight])
    # OverlappedStep(delayed=True): each offloaded group's copy and second gradient buffer
    delayed_update: bool = False
    pinned_host: bool = False   # CUDA compute: host shards and gradients pinned (pinned.py)
    # CPUOffloadPolicy(params_on_device=True): a copy of each offloaded shard that gathers
    # copy in from, on the device in the compute dtype (Note [parameters kept on the device])
    params_on_device: bool = False

    @property
    def shard_device(self) -> torch.device:
        return shard_device_for(self.offload, self.device)

    def offloads(self, layout: GroupLayout) -> bool:
        """Whether ``layout``'s shard, gradients and states live on the host: all groups'
        with ``offload``, else the group's own policy (cpu:FRACTION)."""
        return self.offload or layout.offload

    def shard_device_of(self, layout: GroupLayout) -> torch.device:
        return shard_device_for(self.offloads(layout), self.device)

    def device_copy_bytes(self, layout: GroupLayout) -> int:
        """Bytes of the copy of ``layout``'s shard kept on the device: where its shard is
        offloaded with ``params_on_device`` and its gathers copy the shard in (a cast, a
        move off the host, a batch of units; not where they read the shard as it is)."""
        if not (self.params_on_device and self.offloads(layout)):
            return 0
        plan = gather_plan(shard_size=layout.shard_size, shard_dtype=self.param_dtype,
                           shard_device=self.shard_device_of(layout),
                           compute_dtype=self.compute_dtype, compute_device=self.device,
                           post_forward=layout.after_forward.post_forward_size is not None)
        copies_in = copies_shard_in(plan, batched=len(layout.units) > 1)
        return layout.shard_numel * self.compute_dtype.itemsize if copies_in else 0

    def host_buffer_bytes(self, nbytes: int) -> int:
        """What a host buffer fullshard pins takes (Note [pinned host blocks])."""
        return pinned_block_bytes(nbytes) if self.pinned_host else nbytes


@dataclass
class ReplayGroup:
    """One group's buffers as the replay tracks them (a ParamGroup's, as bytes)."""

    layout: GroupLayout
    index: int
    state: str = "sharded"     # sharded | gathering | unsharded | post_forward
    gather: tuple | None = None  # the gathered buffer (a pool handle), ("chunk", i) or None
    side_gather: tuple | None = None  # tensor-subclass parameters: (send, receive)
    inputs_pending: int = 0   # watched forward calls whose input gradients are to come
    inputs_fired: int = 0
    unwatched: bool = False   # a unit of it ran forward with no input needing grad
    persistent_grads: bool = False

    @property
    def frees_after_forward(self) -> bool:
        # a merged group's units share its rule; a root's run follows the root's
        return frees_after_forward(self.layout.after_forward.reshard, self.layout.is_root)

    @property
    def post_forward_size(self) -> int | None:
        return self.layout.after_forward.post_forward_size
