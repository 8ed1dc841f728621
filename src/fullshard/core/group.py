"""ParamGroup: one unit's parameters, their flat shard and their all-gather / reshard.

The gradient side (laying gradients out, the reduce-scatter, the sharded gradient
buffers) is the group's ``grads`` (core/gradients.py); whether its backward is over,
its ``signals`` (core/schedule.py).

Note [mixed precision]
With a ``param_dtype`` the fp32 flat shard is cast once into this rank's chunk of
the all-gather's output, which is gathered in place (Note [in-place all-gather]);
the unsharded buffer and parameters are in ``param_dtype``, so forward and backward
compute in it and produce gradients in it. ``_chunk_cat`` casts the gradients into
the send buffer in ``reduce_dtype``; the reduced result is cast back into the fp32
gradient buffer, so the optimizer sees fp32 gradients next to fp32 parameters and
states.

A unit is what one ``fully_shard`` call manages. Its parameters share three flat
buffers, so each transition is one collective and one copy (the first two are the
group's ``storage`` and ``unsharded``, both in core/storage.py):

* ``flat_shard``   (S elements): this rank's padded shards, param after param. The
  DTensor parameters' local tensors are views into it, so the optimizer updates it
  in place and, without a cast, the all-gather sends it as is (no copy-in).
* ``unsharded``    (world * S elements, param-major): the unsharded parameters are
  persistent views into it; its storage is freed (resized to 0) while sharded.
* all-gather output (world * S elements, rank-major): temporary; one
  ``split_with_sizes_copy`` moves it into ``unsharded`` (the copy-out).

Gradients go the other way: ``_chunk_cat`` lays the unsharded gradients out
rank-major (one copy-in), one reduce-scatter sums them, and each rank wraps its
slice of the result as DTensor gradients without copying.

Note [in-place all-gather]
A gather whose shard must first be cast or moved to the compute device (mixed
precision, CPU offload) writes the copy-in straight into this rank's chunk of the
rank-major output and gathers in place, as torch's FSDP2 does: no shard-sized send
buffer, and NCCL skips the rank's own chunk (at one rank the collective copies
nothing; the copy-in and the copy-out remain). A quantized gather (Note [quantized
communication]) quantizes from that chunk, and its dequantized copy of every rank's
chunk, this rank's included, then overwrites it, so the ranks still compute with the
same values. Without a cast the gather sends ``flat_shard`` itself, out of place; a batch
of small units, which has no flat shard of its own, always copies its members' shards into
its chunk and gathers in place (Note [a batch reads its members' shards]).

Note [shard groups of one rank]
With one rank per shard group (NO_SHARD: a (world, 1) replicate x shard mesh) the
shard is the whole parameter. Without a cast or offload the unsharded parameters
are views of ``flat_shard`` itself: nothing is gathered, copied or freed, and
memory holds each parameter once, as DDP does. Gradients skip the reduce-scatter
(a copy over one rank) and go straight to one asynchronous all-reduce across
replicas. At world size 1 the same shortcuts apply: no collective, and with offload or
a cast the copy-in alone, on the copy stream (a prefetch overlaps compute). Tests and
benchmarks turn the shortcuts off (``fullshard.testing.collectives_at_one_rank``,
``comm.skips_collectives``) so that one GPU runs the path larger worlds take.

Note [custom collectives]
torch's ``set_custom_all_gather`` / ``set_custom_reduce_scatter`` hand a unit an object
with ``allocate(size, dtype=, device=)`` and a call that runs the collective. With
one set, the group allocates that collective's buffers through it (never from the
pool, so its allocator, e.g. symmetric memory, owns them) and calls it where it would
issue its own: ``comm(output_tensor=, input_tensor=, group=, async_op=)`` for the
gather, ``comm(output_tensor=, input_tensor=, group=, op=ReduceOp.SUM)`` for the
reduce-scatter (fullshard sums and divides afterwards, also under a custom comm). The
reduce-scatter's input is held until its collective has finished (an asynchronous comm
reads it after the call returns), then dropped, never pooled.
Inputs and outputs have the layouts of the built-in path: rank-major shards, one flat
buffer per unit, presence flags and the ledger digest included. A unit with a custom collective is
gathered alone (never in a batch of small units), so the comm sees exactly its parameters.

Note [CPU offload]
With ``offload`` the flat shard, the sharded gradients and hence the optimizer
states live in CPU memory (pinned when the compute device is CUDA, so the copies
can run asynchronously); ``compute_device`` is where gathers, forward and backward
run. Each unshard copies the shard to the compute device (the copy-in that also
casts under mixed precision) before the all-gather; each reduce lands in a
compute-device buffer that is then copied into the CPU gradients. On a CPU-only
machine both devices are the CPU and the same copies run, so the path is tested.

Note [inference mode]
A forward under ``torch.inference_mode()`` may be the first to gather a unit. Tensors
created there are inference tensors, which no code outside inference mode may update in
place: a persistent buffer (the unsharded buffer, a pooled one, a post-forward chunk)
made then would break the next training forward's gather. So the group's transitions
run with inference mode off (and autograd off, which turning it off would enable):
their buffers stay ordinary tensors, the unsharded parameters views of them, and only
what the module computes under inference mode is an inference tensor.

Note [gathering inside torch.func transforms]
A forward inside ``torch.func.jvp`` (or ``vmap``, ``grad``) may be the first to gather a
unit. Under a transform every tensor a factory function makes is wrapped for that
transform's level: the unsharded buffer built then was a wrapper with no storage to
resize, and the gather failed ("Cannot access storage of TensorWrapper"). The group's
transitions therefore run with the transforms switched off, as FSDP2's do: buffers and
unsharded parameters are plain tensors, and only the module's own computation is
transformed (it wraps the parameters it reads, as for any module).

Note [parameters kept gathered across backward]
``set_reshard_after_backward(False)`` keeps a unit's parameters gathered for the next
forward (no all-gather there). Between the backward and that forward the module shows the
sharded parameters again (state KEPT), as after any other backward: they hold the reduced
gradients, so ``clip_grad_norm_(model.parameters())``, an optimizer built from
``model.parameters()`` and ``state_dict()`` see what they would see without the flag.
torch's FSDP2 leaves the gathered parameters registered, whose gradients are gone after
the reduction: a clip over ``model.parameters()`` there finds no gradient and clips
nothing. The next forward registers the gathered parameters again, without a collective.

Unless the shard changed since the gather: an optimizer step, a load or any other
in-place write leaves the gathered values stale, and torch's FSDP2 computes the next
forward with them, silently. A gather notes the version counters of what it reads (the
flat shard's, each DTensor's local tensor's and each DTensor parameter's own: every
in-place write raises one of them; an op on the parameter, ``nn.init`` included, raises
only the last, as a DTensor writes its local tensor below autograd); the optimizer hook
raises the local tensor's for each parameter a step updated, also where the optimizer
wrote through ``.data``, which autograd does not count. A kept group
whose shard changed is gathered again, as is one the user gathered ahead with
``unshard()`` before a step (the root's pre-forward checks both). Kept across the
micro-batches of an accumulation, with no step between them, nothing is gathered again. A
one-rank group whose parameters are the shard itself is never stale.

The finding is each rank's own, with no collective to agree on it: an optimizer step runs
on every rank and raises the counters of every parameter it stepped (empty shards too), so
the ranks agree. A write the user makes on some ranks only makes those ranks gather alone;
the ledger enters that gather as "the all-gather again", so the divergence guard names it
(E29) rather than leaving a hang.
"""

from __future__ import annotations

import contextlib
import enum
import functools
from typing import TYPE_CHECKING, Callable, NamedTuple

import torch
import torch.distributed as dist

from .comm import BufferPool, HostCopies, Pending, all_gather, skips_collectives, traced
from .comm_groups import DEFAULT_COMM, CommOptions
from .guard.ledger import GATHER_AGAIN
from .features.mapped import page_out
from .features.quantized_collectives import quantized_all_gather
from .storage import ShardStorage, UnshardedBuffer
from .gradients import GradReduction
from .features.grad_dtype import follow as follow_grad_dtypes
from .param import ShardedParam
from .features.pending_shard import PendingShard
from .features.post_forward import PostForwardShard
from .schedule import BackwardSignals, GatherPlan, copies_shard_in, gather_plan
from .features.subclass_params import SubclassGather

if TYPE_CHECKING:
    from ..policies import CPUOffloadPolicy
    from .guard.divergence import Guard


class GroupState(enum.Enum):
    SHARDED = "sharded"        # only the shards exist; sharded DTensors are registered
    GATHERING = "gathering"    # all-gather issued, not yet copied out
    UNSHARDED = "unsharded"    # unsharded params registered and valid
    KEPT = "kept"              # sharded registered; the gathered ones kept for the next forward
    POST_FORWARD = "post-forward"  # sharded, plus a 1/N chunk kept for backward (hpZ)


def outside_special_modes(transition: Callable) -> Callable:
    """Run a group transition with inference mode off (Note [inference mode]) and
    outside torch.func's transforms (Note [gathering inside torch.func transforms])."""
    @functools.wraps(transition)
    def run(*args, **kwargs):
        inference = torch.is_inference_mode_enabled()
        transformed = torch._C._are_functorch_transforms_active()
        if not inference and not transformed:
            return transition(*args, **kwargs)
        with contextlib.ExitStack() as modes:
            if inference:
                modes.enter_context(torch.inference_mode(False))
                modes.enter_context(torch.no_grad())
            if transformed:
                modes.enter_context(torch._C._DisableFuncTorch())
            return transition(*args, **kwargs)
    return run


class _Gather(NamedTuple):
    """A group's gather in flight (its state GATHERING): what to wait on; ``direct``: it
    writes the unsharded buffer itself (else a rank-major buffer copied out after);
    ``pooled``: that buffer is the pool's (a custom or staged one belongs to its allocator)."""
    pending: Pending
    direct: bool
    pooled: bool = True

    def give_back(self, gathered: torch.Tensor, pool: BufferPool) -> None:
        """Return the rank-major buffer once copied out (or dropped)."""
        if self.pooled:
            pool.give(gathered)


class ParamGroup:
    """The parameters of one unit and the collectives that move them."""

    def __init__(self, params: list[ShardedParam], pg: dist.ProcessGroup, unit_name: str,
                 param_dtype: torch.dtype | None = None,
                 reduce_dtype: torch.dtype | None = None,
                 replicate_pg: dist.ProcessGroup | None = None,
                 post_forward_size: int | None = None,
                 offload: "CPUOffloadPolicy | None" = None,
                 compute_device: torch.device | None = None, mesh=None,
                 mp_policy=None, storage: "ShardStorage | None" = None):
        self.params = params
        # Note [tensor-subclass parameters]: those gather beside the flat buffers
        self.flat_params = [p for p in params if p.extension is None]
        subclass = [p for p in params if p.extension is not None]
        self.subclass = SubclassGather(subclass, pg, mesh, unit_name) if subclass else None
        self.mp_policy = mp_policy
        self.offload = offload  # Note [CPU offload]
        for p in params:  # the optimizer hook asks a parameter (Note [optimizer states on disk])
            p.offload = offload
        # the flat shard (core/storage.py); a batch reads its members' (core/batch.py)
        self.storage = storage if storage is not None else ShardStorage(
            self.flat_params, unit_name, offload, compute_device)
        self.post_forward_size = post_forward_size
        self.post_forward: PostForwardShard | None = (
            PostForwardShard(pg, post_forward_size) if post_forward_size else None)
        self.replicate_pg = replicate_pg  # hybrid sharding: all-reduce across replicas
        # Mixed precision (Note [mixed precision]): gather and compute in param_dtype,
        # reduce gradients in reduce_dtype (default: param_dtype); None = shard dtype.
        self.param_dtype = param_dtype
        self.reduce_dtype = reduce_dtype
        self.pg = pg
        self.world_size = pg.size()
        self.unit_name = unit_name
        # what gathers and reduces this group: itself, or the batch of small units it
        # joined at lazy init (Note [buckets: units gather together])
        self.batch: ParamGroup = self
        self.state = GroupState.SHARDED
        # the gathered parameters (core/storage.py)
        self.unsharded = UnshardedBuffer(self.storage, self.world_size)
        self._in_flight: _Gather | None = None  # while GATHERING
        # the shard's version counter when the gather in flight or done read it (Note
        # [parameters kept gathered across backward]); None while sharded
        self._gathered_version: int | None = None
        self._gathering_again = False  # the next gather replaces kept, stale parameters
        self.signals = BackwardSignals()  # Note [when a unit's backward is done]
        # an optimizer step of this group's offloaded shards running on a host thread
        # (Note [the host step overlapped with the next forward]): a Future, or None
        self.host_step = None
        # Note [the delayed update]: the copy of the shard gathers read while a delayed
        # host step writes the shard; None until the unit's first delayed step
        self.delayed: PendingShard | None = None
        self.pool = BufferPool()  # the root shares one pool among its groups at lazy init
        self.copies = HostCopies(torch.device("cpu"))  # the root's, from lazy init on
        # the root's divergence guard and this group's unit code in its ledger
        # (Note [ranks agree on every collective]); None while there is no root or one rank
        self.guard: "Guard | None" = None
        self.guard_unit = -1
        # torch's set_custom_all_gather / set_custom_reduce_scatter (Note [custom collectives])
        self.all_gather_comm = None
        self.reduce_scatter_comm = None
        # set_quantized_communication: int8 blocks of this many elements, 0 for off
        # (see Note [quantized communication])
        self.quantize_weights = 0
        self.quantize_grads = 0
        # torch's communication setters: a reduce-scatter group of its own, reductions in
        # flight, staging buffers not from the pool (core/comm_groups.py)
        self.comm_options: CommOptions = DEFAULT_COMM
        self.grads = GradReduction(self)  # the gradient side (core/gradients.py)

    @property
    def reduce_scatter_pg(self) -> dist.ProcessGroup:
        """Where gradient reduce-scatters run: the shard group, or one of their own
        (Note [a reduce-scatter group of its own])."""
        return self.comm_options.reduce_pg or self.pg

    @property
    def state(self) -> GroupState:
        """Where the parameters are; a group in a batch is where its batch is."""
        return self._state if self.batch is self else self.batch.state

    @state.setter
    def state(self, state: GroupState) -> None:
        self._state = state

    def _record(self, op: str, numel: int) -> None:
        """Enter a collective about to be issued in the root's ledger (Note [ranks agree on
        every collective])."""
        if self.guard is not None:
            self.guard.collective(op, self.guard_unit, numel)

    @property
    def patience(self):
        """What a wait calls after each slice it has waited (Note [ranks agree on every
        collective]); None where waiting does not block the host (NCCL), where the guard
        compares a step behind (Note [a comparison one step behind]) or unguarded."""
        guard = self.guard
        if guard is None or guard.lagged or self.compute_device.type != "cpu":
            return None
        return guard

    # -- construction -------------------------------------------------------------------
    def shard(self, originals: list[torch.Tensor], device: torch.device) -> None:
        """Allocate the flat shard on ``device`` and copy each original's rows into it."""
        requires_grad = {p: t.requires_grad for p, t in zip(self.params, originals)}
        full = {p: p.local_value(t) for p, t in zip(self.params, originals)}
        originals = [full[p] for p in self.flat_params] or list(full.values())
        dtypes = {t.dtype for t in originals}
        if len(dtypes) > 1:
            found = ", ".join(f"{p.fqn}: {t.dtype}" for p, t in zip(self.flat_params, originals))
            raise TypeError(
                f"fully_shard({self.unit_name}): all parameters of one unit must share a dtype "
                f"to be gathered in one collective; found {found}. Cast them to one dtype or "
                "shard the differing submodules in their own fully_shard call.")
        self.storage.fill(full, requires_grad, originals[0].dtype, device)
        for p in self.subclass.params if self.subclass is not None else ():
            p.shard_subclass(full[p], self.unit_name, requires_grad=requires_grad[p],
                             device=self.storage.device_for(device))

    @property
    def flat_shard(self) -> torch.Tensor | None:
        """This rank's shards of the unit's plain parameters, in one tensor (the storage's)."""
        return self.storage.tensor

    @property
    def compute_device(self) -> torch.device:
        """Where gathered parameters live and forward/backward run."""
        return self.storage.compute_device

    def readopt(self, copy_values: bool = True) -> None:
        """Re-point every DTensor at ``flat_shard`` after a module ``_apply`` or an
        ``assign=True`` load replaced them; reallocate when device or dtype changed
        (and copy their values over, unless ``copy_values`` is False: ``to_empty``). In a
        batch, the batch is resharded first and rebuilds its gathered buffer (which
        ``unsharded`` then is) for the new shard."""
        self.reshard()
        first = (self.flat_params or self.params)[0].refs[0]
        current = first.module._parameters[first.name]
        if self.storage.readopt(getattr(current, "_local_tensor", current), copy_values):
            self.unsharded.forget()  # built again, for the new shard's device and dtype
            policy = self.mp_policy
            if policy is not None and policy.reduce_dtype is None and self.subclass is None \
                    and not any(p.extension is not None for p in self.params):
                # a default reduction follows the parameters' new dtype (module.to(float64)
                # after fully_shard), as torch's FSDP2 reads it at lazy init
                self.reduce_dtype = policy.reduce_dtype_for(self.storage.dtype)
                follow_grad_dtypes(self)  # Note [a parameter's grad_dtype]
                self.batch.reduce_dtype = self.reduce_dtype
        for p in self.subclass.params if self.subclass is not None else ():
            p.readopt(None)

    @property
    def aliases_shard(self) -> bool:
        """Whether the unsharded parameters are views of the flat shard itself
        (Note [shard groups of one rank])."""
        return not self._gather_plan().unsharded

    def _gather_plan(self) -> GatherPlan:
        """What an unshard allocates (core/schedule.py)."""
        return gather_plan(shard_size=self.world_size, shard_dtype=self.storage.dtype,
                           shard_device=self.storage.device, compute_dtype=self.compute_dtype,
                           compute_device=self.compute_device,
                           post_forward=self.post_forward is not None,
                           delayed=self.delayed is not None)

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype parameters are gathered and computed in."""
        return self.param_dtype or self.storage.dtype

    # -- unshard / reshard --------------------------------------------------------------
    @outside_special_modes
    def unshard(self, async_op: bool = False) -> None:
        """Start gathering the parameters. The transitions: SHARDED -> GATHERING (the
        shards' all-gather, or a copy where one rank holds everything); POST_FORWARD ->
        GATHERING (from the 1/N chunk kept after forward); KEPT -> UNSHARDED with no
        collective, or, when the shard was written since, KEPT -> SHARDED -> GATHERING;
        GATHERING and UNSHARDED stay as they are. ``wait_unshard`` then ends GATHERING
        in UNSHARDED. A group in a batch gathers its batch."""
        if self.batch is not self:
            return self.batch.unshard(async_op)
        self.finish_host_step_read()  # the shard a gather reads is the stepped one
        if self.state is GroupState.KEPT:
            if not self.shard_written_since_gathered():
                self._register_unsharded()  # as gathered: no collective
                return
            self.reshard_stale()
        if self.state is GroupState.POST_FORWARD:
            gather = self._gather_post_forward_chunk(async_op)
        elif self.state is GroupState.SHARDED:
            gather = self._gather_shards(async_op)
        else:
            return
        self._in_flight = gather
        self.state = GroupState.GATHERING
        if not async_op:
            self.wait_unshard()

    def _gather_post_forward_chunk(self, async_op: bool) -> "_Gather":
        """POST_FORWARD -> GATHERING: the parameters from the chunk kept after forward."""
        self.unsharded.allocate()
        writer = self.unsharded.writer
        self._record("all-gather (post-forward subgroup)", writer.numel())
        return _Gather(self.post_forward.gather_into(writer, async_op=async_op,
                                                     patience=self.patience), direct=True)

    def _gather_shards(self, async_op: bool) -> "_Gather":
        """SHARDED -> GATHERING: the tensor-subclass parameters' own gathers, then the flat
        shards': a collective, or the copy a shard group of one rank makes."""
        self._gathered_version = self._shard_version()
        if not self.unsharded.built:
            self.unsharded.build(self.aliases_shard, self.compute_dtype, self.compute_device)
        if self.subclass is not None:  # Note [tensor-subclass parameters]
            self._record("all-gather (tensor-subclass parameters)", len(self.subclass.params))
            self.subclass.start(self.mp_policy, self.pool, async_op, self.compute_device)
            if not self.flat_params:
                return _Gather(Pending(self.unsharded.tensor, None), direct=True)
        if skips_collectives(self.world_size):  # Note [shard groups of one rank]
            pending = Pending(self.unsharded.tensor, None)
            if not self.unsharded.is_shard:  # cast / to the device: the copy
                self.unsharded.allocate()     # stream, so a prefetch overlaps compute
                with self.copies.to_device() as ordered, traced("copy_in", self.unit_name):
                    self._copy_source_into(self.unsharded.writer)
                    pending = ordered(pending)
            return _Gather(pending, direct=True)
        return self._all_gather(async_op)

    def _all_gather(self, async_op: bool) -> "_Gather":
        """The flat shards' all-gather into a rank-major buffer (copied out, param-major,
        by ``wait_unshard``)."""
        dtype, device = self.compute_dtype, self.compute_device
        # None for a batch without a copy to read: its members' shards are copied in
        send = self.delayed.tensor if self.reads_pending else self.storage.tensor
        comm = self.all_gather_comm
        self._record("all-gather" if not self._gathering_again else GATHER_AGAIN,
                     self.world_size * self.storage.numel)
        self._gathering_again = False
        # On CUDA the copy-in and the collective run on the copy stream while compute goes
        # on (Note [streams and events]); ``ordered`` makes the caller's stream wait for it.
        plan = self._gather_plan()
        with self.copies.to_device() as ordered, traced("all_gather", self.unit_name):
            numel = self.world_size * self.storage.numel
            # see Note [staging buffers from the process group]
            staging = self.comm_options.gather_staging
            if comm is not None:
                out, pooled = comm.allocate((numel,), dtype=dtype, device=device), False
            elif staging is not None:
                out, pooled = staging.take(self.pool, self.pg, numel, dtype, device)
            else:
                out, pooled = self.pool.take(numel, dtype, device), True
            # the one copy-in (Note [in-place all-gather]); a batch that reads no pending
            # copy has no shard of its own to send
            if copies_shard_in(plan, batched=send is None):
                send = self._own_chunk(out)
                self._copy_source_into(send)
            if comm is None and self.quantize_weights:  # Note [quantized communication]
                pending = quantized_all_gather(out, send, self.pg, self.quantize_weights,
                                               async_op=async_op, patience=self.patience,
                                               what=f"all-gather of {self.unit_name}")
            elif comm is None:
                pending = all_gather(out, send, self.pg, async_op=async_op,
                                     what=f"all-gather of {self.unit_name}",
                                     patience=self.patience)
            else:  # Note [custom collectives]
                pending = Pending(out, comm(output_tensor=out, input_tensor=send,
                                            group=self.pg, async_op=async_op))
            return _Gather(ordered(pending), direct=False, pooled=pooled)

    @outside_special_modes
    def wait_unshard(self) -> None:
        """Finish a pending gather: copy out and register the unsharded params."""
        if self.batch is not self:
            return self.batch.wait_unshard()
        if self.state is not GroupState.GATHERING:
            return
        gather, self._in_flight = self._in_flight, None
        gathered = gather.pending.wait(f"all-gather of {self.unit_name}", self.patience)
        if self.storage.on_disk and self.storage.tensor is not None:
            page_out(self.storage.tensor)  # the collective read the shard itself (no copy-in)
        if not gather.direct:  # gathered rank-major: copy out, param-major
            self.unsharded.allocate()
            with traced("copy_out", self.unit_name):
                self.unsharded.copy_out(gathered.view(self.world_size, -1))
            gather.give_back(gathered, self.pool)
            self.copies.reads_done()  # the copy stream's blocks: Note [streams and events]
        if self.subclass is not None:
            self.subclass.finish(self.param_dtype)
        self._register_unsharded()

    def _register_unsharded(self) -> None:
        for p in self.params:
            up = p.unsharded_param
            if up.requires_grad != p.sharded_param.requires_grad:  # the user (un)froze it
                up.requires_grad_(p.sharded_param.requires_grad)
            p.register(up)
        self.state = GroupState.UNSHARDED

    def finish_host_step(self) -> None:
        """Wait for the optimizer step of this group's shards on a host thread, if one runs
        (Note [the host step overlapped with the next forward]); its error is raised here."""
        job, self.host_step = self.host_step, None
        if job is not None:
            job.result()

    @property
    def reads_pending(self) -> bool:
        """Whether gathers read the copy taken before a delayed host step rather than the
        shard (Note [the delayed update])."""
        return self.delayed is not None and self.delayed.pending

    def _copy_source_into(self, dst: torch.Tensor) -> None:
        """Copy what a gather reads into ``dst``: the shard (a batch's: its members'), or
        under a delayed host step the copy of it taken before that step (Note [the
        delayed update])."""
        if self.reads_pending:
            dst.copy_(self.delayed.tensor, non_blocking=True)
        else:
            self.storage.copy_into(dst)

    def finish_host_step_read(self) -> None:
        """Before a gather, or before gradients are written: wait for the host step
        unless it is a delayed one, whose gathers read a copy and whose gradients were
        handed over in a buffer of their own (Note [the delayed update])."""
        if not self.reads_pending:
            self.finish_host_step()

    def start_delayed_read(self) -> None:
        """Gathers read a copy of the shard as it is now, until ``stop_delayed_read``;
        the gradient buffer kept across steps goes with the step about to be handed out.
        Whatever is gathered now was read before: it is dropped, the same on every rank."""
        self.reshard()
        if self.delayed is None:
            self.delayed = PendingShard()
            if self.unsharded.is_shard:  # Note [shard groups of one rank]: views of the
                self.unsharded.forget()  # shard the host thread writes; gather a copy
        self.delayed.take(self.storage)
        self.grads.hand_off_kept()

    def stop_delayed_read(self) -> None:
        """Gathers read the shard again (an exact step, a load of the parameters); a group
        in a batch: the batch's gathers, which read its shard."""
        if self.batch is not self:
            return self.batch.stop_delayed_read()
        if self.reads_pending:
            self.reshard()
            self.delayed.drop()

    def keep_for_next_forward(self) -> None:
        """After a backward that keeps the parameters gathered: register the sharded ones,
        which hold the gradients, and keep the gathered buffer for the next forward
        (Note [parameters kept gathered across backward])."""
        if self.state is not GroupState.UNSHARDED:
            return
        for p in self.params:
            p.register(p.sharded_param)
        self.state = GroupState.KEPT

    @outside_special_modes
    def reshard_after_forward(self) -> None:
        """Free the parameters after forward; with a post-forward group (hpZ, Note
        [resharding after forward to a smaller group]) keep this rank's chunk first."""
        if self.post_forward is not None and self.state is GroupState.UNSHARDED:
            self.post_forward.keep(self.unsharded.writer)
            read_version = self._gathered_version  # the kept chunk is as that gather read it
            self.reshard()
            self.state = GroupState.POST_FORWARD
            self._gathered_version = read_version
        else:
            self.reshard()

    @outside_special_modes
    def reshard(self) -> None:
        """Register the sharded params again and free the unsharded storage (a group in
        a batch: the batch's)."""
        if self.batch is not self:
            return self.batch.reshard()
        if self.state is GroupState.SHARDED:
            return
        if self.state is GroupState.POST_FORWARD:  # parameters already registered sharded
            self.post_forward.drop()
        elif self.state is GroupState.GATHERING:
            # never drop a buffer under a live collective
            gather, self._in_flight = self._in_flight, None
            gathered = gather.pending.wait(f"all-gather of {self.unit_name}", self.patience)
            if not gather.direct:
                gather.give_back(gathered, self.pool)
            if self.subclass is not None:
                self.subclass.drop()
        else:
            for p in self.params:
                p.register(p.sharded_param)
        self.unsharded.free()
        if self.subclass is not None and not self.unsharded.keep_storage:
            self.subclass.free()
        self.state = GroupState.SHARDED
        self._gathered_version = None

    def reshard_stale(self) -> None:
        """Drop parameters kept gathered whose shard this rank wrote since (Note
        [parameters kept gathered across backward]); the gather that follows is entered in
        the ledger as a gather again, which names a write made on some ranks only."""
        self.reshard()
        self._gathering_again = True

    def shard_written_since_gathered(self) -> bool:
        """Whether the shard was written in place (an optimizer step, a load) after the
        gathered parameters were read from it: they are stale then (Note [parameters
        kept gathered across backward])."""
        return (self._gathered_version is not None and not self.aliases_shard
                and self._gathered_version != self._shard_version())

    def _shard_version(self) -> int:
        """A count that any in-place write of what a gather reads raises: the flat shard's
        write count (``ShardStorage.written()``, which the copy kept on the device is
        refreshed by too) and each tensor-subclass parameter's (``ShardedParam.written()``)."""
        if self.reads_pending:  # what the gather reads; the host thread writes the rest
            return self.delayed.tensor._version
        version = self.storage.written() if self.flat_params else 0
        for p in self.subclass.params if self.subclass is not None else ():
            version += p.written()
        return version

    def _own_chunk(self, gathered: torch.Tensor) -> torch.Tensor:
        """This rank's chunk of a rank-major all-gather output: its send buffer when the
        gather runs in place."""
        return gathered.narrow(0, self.pg.rank() * self.storage.numel, self.storage.numel)

    # -- gradients ------------------------------------------------------------------------
    def trainable(self) -> list[ShardedParam]:
        return [p for p in self.params if p.sharded_param.requires_grad]

    def forget_backward(self) -> None:
        """Drop this group's gradients not yet reduced and its backward bookkeeping."""
        self.signals.forget()
        self.grads.forget()
