"""Explicit run-time state: one UnitState per ``fully_shard`` call, one RootState per tree.

The root is the outermost sharded module whose forward runs first; at that moment
it claims every unit below it (lazy init). Per-iteration bookkeeping lives on the
RootState so that units stay plain descriptions of themselves: the order units ran in
(``order``), and everything one backward needs from the forward that records it to the
final callback that ends it, in one ``BackwardState`` (``root.backward``).
"""

from __future__ import annotations

import dataclasses
import itertools
import weakref
from typing import Callable

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from ..policies import MixedPrecisionPolicy
from .comm import BufferPool, SharedCopies
from .gradients import (DEFAULT_REDUCE, PendingReduce, ReduceOptions, UnknownPresence,
                        resolve_all)
from .guard.ledger import BACKWARD
from .group import ParamGroup
from .schedule import ForwardsFinished, PrefetchOrder, frees_after_forward


# Merge adjacent units up to this many unsharded elements (4 MiB of fp32); see
# Note [buckets: units gather together].
DEFAULT_BUCKET_NUMEL = 1 << 20


_UNIT_KEY = "_fullshard_unit"  # where a module keeps its UnitState; read only below


def unit_of(module: nn.Module) -> "UnitState | None":
    """The UnitState ``fully_shard`` attached to ``module``; None for other modules."""
    return module.__dict__.get(_UNIT_KEY)


def units_in(module: nn.Module) -> "list[UnitState]":
    """The units ``fully_shard`` made in ``module`` and below it, in module order (the
    same on every rank)."""
    return [u for u in map(unit_of, module.modules()) if u is not None]


def attach_unit(module: nn.Module, unit: "UnitState") -> None:
    """Make ``unit`` the state ``unit_of(module)`` returns (once, at shard time)."""
    module.__dict__[_UNIT_KEY] = unit


class UnitState:
    """What one ``fully_shard(module)`` call manages."""

    def __init__(self, module: nn.Module, name: str, mesh: DeviceMesh,
                 group: ParamGroup | None, reshard_after_forward: bool | None,
                 mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(), debug: bool = False):
        self.module = module
        self.label = name  # the module's class name, for messages about the root
        self.name = name
        self.mesh = mesh
        self.group = group
        self.reshard_after_forward = reshard_after_forward  # as given: see reshards_after_forward
        self.mp_policy = mp_policy
        self.root: RootState | None = None
        self.pre_backward_hook = None  # set by hooks.install
        self.bucket_numel = DEFAULT_BUCKET_NUMEL  # used when this unit becomes the root
        # as the root: compare before every collective (core/guard/divergence.py)
        self.debug = debug
        self.own_params: list = group.params if group is not None else []
        # Per iteration:
        self.requires_gradient_sync = True  # False: keep unsharded grads, reduce later
        self.reshard_after_backward = True  # False: stay gathered for the next forward
        self.is_last_backward = True  # root only: False leaves the last reduce in flight
        # root only: the caller finishes backward with finalize_backward (torch 2.15's
        # set_manual_backward_finalization); supersedes is_last_backward
        self.manual_backward_finalization = False
        # Explicit prefetch (set_modules_to_*_prefetch); None means implicit: next group
        self.forward_prefetch: list[UnitState] | None = None
        self.backward_prefetch: list[UnitState] | None = None
        # True: the implicit backward prefetch starts once this unit's gradients are
        # computed and its parameters freed (FSDP1's BACKWARD_POST), not when its backward starts
        self.backward_prefetch_after_grads = False
        self.explicit_unshard = False   # the user called module.unshard(): keep it at pre-forward
        self.reduce_options: ReduceOptions = DEFAULT_REDUCE  # torch's gradient-reduction setters
        self.unshard_in_backward = True  # False: backward never gathers (e.g. an embedding)
        self.post_optim_event = None     # root only: waited on before the next forward's gathers
        self.shared_copies = SharedCopies()  # as a root: its copy streams (share_comm_ctx)
        # The units one fully_shard call made: itself, or every module of a list, which
        # share one group; torch's per-unit setters apply to all of them together.
        self.created_with: list[UnitState] = [self]
        # The units its fully_shard call split off for parameters on meshes of their own,
        # gathered with it (Note [parameters on meshes of their own])
        self.companions: list[UnitState] = []
        self.ledger_code = 0  # this unit in its root's ledger (core/guard/ledger.py)

    @property
    def batch(self) -> ParamGroup | None:
        """What gathers and reduces this unit's parameters: its group, or the batch of
        small units the group joined at lazy init (Note [buckets: units gather together]).
        The schedule asks this; ``group`` stays the unit's own for life."""
        group = self.group
        return group.batch if group is not None else None

    def gathered_together(self) -> list["UnitState"]:
        """This unit and its companions: what gathering it gathers."""
        return [self, *self.companions]

    def rename(self, path: str) -> None:
        """Name the unit and its parameters by their path from the root (for messages)."""
        self.name = path or self.label
        if self.group is not None:
            self.group.unit_name = self.name  # messages name units by path
        for p in self.own_params:
            p.fqn = f"{path}.{p.refs[0].fqn}" if path else p.refs[0].fqn

    @property
    def reshards_after_forward(self) -> bool:
        """Whether this unit frees its parameters after forward (torch's rule for ``None``
        and the root: core/schedule.py)."""
        return frees_after_forward(self.reshard_after_forward, self.is_root)

    @property
    def is_root(self) -> bool:
        return self.root is not None and self.root.unit is self

    def __repr__(self) -> str:
        return f"UnitState({self.name})"


# Every root alive in the process, in the order they were made. Process-wide because
# optimizer.step() must finish the reduce-scatters left in flight by
# set_is_last_backward(False) (optim.py), and an optimizer knows only its tensors, not the
# model; weak, so a dropped model goes. Ordered, because settling a root may issue
# collectives (a replica all-reduce, the guard's comparison): every rank must settle its
# roots in one order, and a WeakSet's order is its objects' addresses, which differ by rank.
_LIVE_ROOTS: "weakref.WeakValueDictionary[int, RootState]" = weakref.WeakValueDictionary()
_ROOTS_MADE = itertools.count()


def live_roots() -> list["RootState"]:
    """The roots alive now, oldest first (the same order on every rank)."""
    return list(_LIVE_ROOTS.values())


def groups_in_order() -> tuple[dict[int, ParamGroup], dict[ParamGroup, int]]:
    """Every live group by its ShardedParams' ids, and the groups' order: their units'
    order under each root (the order forward gathers them). A group is what reduces
    together: a unit's batch (Note [buckets: units gather together])."""
    groups: dict[int, ParamGroup] = {}
    order: dict[ParamGroup, int] = {}
    for root in live_roots():
        for unit in root.units:
            group = unit.batch
            if group is None or group in order:
                continue
            order[group] = len(order)
            for sharded in group.params:
                groups[id(sharded)] = group
    return groups, order


def finish_host_steps(owners=None) -> None:
    """Wait for the optimizer steps running on a host thread (Note [the host step
    overlapped with the next forward]): every one, or those of the groups holding any of
    ``owners`` (ShardedParams; an iterable read only when a step is running)."""
    running = [group for root in live_roots() for group in root.members
               if group.host_step is not None]
    if not running:
        return
    wanted = None if owners is None else set(owners)
    for group in running:
        if wanted is None or any(p in wanted for p in group.params):
            group.finish_host_step()


def finish_all_pending_reduces() -> None:
    """Complete every reduce-scatter left in flight and every gradient copy to the host
    (Optimizer.step calls this first)."""
    for root in live_roots():
        root.settle_gradients()


class BackwardState:
    """One root's backward, from the forwards that record what it must reduce to the
    final callback that ends it (Note [when a unit's backward is done]).

    Each group counts its own watches' signals (``group.signals``, core/schedule.py):
    a forward's watch stays live until its graph is freed, past any one backward."""

    def __init__(self) -> None:
        self.running = False  # from the first output gradient to the final callback
        # backward(create_graph=True) / autograd.grad(..., create_graph=True): the graph it
        # builds reads the gathered parameters, so this backward leaves them gathered
        self.creates_graph = False
        # the units whose forward ran with grad in the graph a backward may go through:
        # those since the last backward, else the last backward's own (a second backward
        # through it, retain_graph, reduces them again), until a forward with grad
        self.ran_with_grad: set[UnitState] = set()
        self.backpropagated = False  # ran_with_grad is a graph a backward went through
        # reentrant activation checkpointing: the forward ran without grad and its
        # recomputation in backward is what autograd goes through (watched there)
        self.recomputed: set[UnitState] = set()
        self.reduced: set[ParamGroup] = set()  # groups reduced in this backward
        # the reductions in flight, oldest first: at most the root's reduces_in_flight
        # (Note [reductions in flight]), and one all-reduce across replicas (Note [the
        # replica all-reduce in flight])
        self.pending_reduces: list[PendingReduce] = []
        self.replica_reduce: PendingReduce | None = None
        self.unknown_presence: list[UnknownPresence] = []  # Note [gradient presence flags]
        # told of each reduction as its gradients are handed out: the parameters and
        # whether every one of them got a gradient on some rank (Note [the host step
        # overlapped with backward] in overlapped_step.py); None: nobody listens
        self.on_reduced: Callable[[list, bool], None] | None = None
        self.handle = None  # finalize_backward(async_op=True)'s, until waited
        self.passes = 0  # backward passes ended (when late gradients are looked for)
        self.ended_since_settle = False  # a backward ended since the last settle

    def expects_gradients(self, unit: UnitState) -> bool:
        """Whether ``unit``'s forward, or its recomputation, ran with grad."""
        return unit in self.ran_with_grad or unit in self.recomputed

    def forward_with_grad(self, unit: UnitState) -> None:
        """``unit``'s forward ran with grad outside a backward. The first after a backward
        starts a new graph: the last backward's units are no longer expected unless they
        run again."""
        if self.backpropagated:
            self.ran_with_grad.clear()
            self.backpropagated = False
        self.ran_with_grad.add(unit)

    def end(self) -> None:
        """The final callback is done: what this backward reduced is forgotten; whose
        forwards it covered stay expected until a forward with grad (Note [when a unit's
        backward is done]: a graph backpropagated twice)."""
        self.reduced.clear()
        self.backpropagated = True
        self.recomputed.clear()
        self.running = False
        self.creates_graph = False

    def forget(self) -> None:
        """``reset_iter_state``: no graph of the aborted iteration is expected again."""
        self.end()
        self.ran_with_grad.clear()
        self.backpropagated = False


class RootState:
    """Iteration state shared by every unit under one root.

    Several units may be gathered by one batch (core/buckets.py): ``members`` maps each
    batch (``UnitState.batch``: a unit's own group when it is alone) to its units, and
    the per-iteration sets say which units finished forward and which batches finished
    backward.
    """

    def __init__(self, unit: UnitState, units: list[UnitState]):
        self.unit = unit
        self.units = units
        self.backward = BackwardState()
        self.members: dict[ParamGroup, list[UnitState]] = {}
        for u in units:
            if u.batch is not None:
                self.members.setdefault(u.batch, []).append(u)
        self.forwards: ForwardsFinished[UnitState, ParamGroup] = ForwardsFinished()
        self.pool = BufferPool()
        for group in self.members:
            group.pool = self.pool
        self.reduces_in_flight = 1
        self.update_reduces_in_flight()
        self.use_copies(unit.shared_copies)
        _LIVE_ROOTS[next(_ROOTS_MADE)] = self
        self.order: PrefetchOrder[UnitState, ParamGroup] = PrefetchOrder(lambda u: u.batch)
        # Note [ranks agree on every collective]: set at lazy init when the mesh has more
        # than one rank
        self.guard = None

    @property
    def patience(self):
        """The guard where waits are sliced to compare with stalled peers (the host waits
        in them: CPU), else None (Note [ranks agree on every collective])."""
        guard = self.guard
        return guard if guard is not None and not guard.lagged else None

    # -- orders -------------------------------------------------------------------------
    def record_pre_forward(self, unit: UnitState) -> None:
        self.order.record_pre_forward(unit)

    def start_iteration(self) -> None:
        self.order.start_iteration()
        self.forwards.start_iteration()

    def stays_gathered_after_backward(self, group: ParamGroup) -> bool:
        """Whether every unit sharing ``group`` asked to keep it gathered after backward."""
        return not any(u.reshard_after_backward for u in self.members[group])

    def forward_finished(self, unit: UnitState) -> bool:
        """Record ``unit``'s forward; True once every unit sharing its group has run."""
        return self.forwards.finished(unit, unit.batch, len(self.members[unit.batch]))

    def record_post_forward(self, unit: UnitState) -> None:
        self.order.record_post_forward(unit)

    def next_group_in_forward(self, unit: UnitState) -> ParamGroup | None:
        """The first other group forward will need after ``unit`` (last iteration's order):
        the one to prefetch while ``unit``'s group computes."""
        return self.order.next_in_forward(unit)

    def prev_group_in_forward(self, unit: UnitState) -> ParamGroup | None:
        """The last other group whose forward finished before ``unit``'s: the next one
        backward reaches, hence the one to prefetch in backward."""
        return self.order.prev_in_forward(unit)

    def reset_iteration(self) -> None:
        """``reset_iter_state``: after an exception aborted a forward or backward, wait for
        collectives in flight, reshard every group, drop the aborted iteration's gradients
        (also those accumulated without sync) and its bookkeeping. The forward order
        recorded by the last complete iteration is kept for prefetching."""
        backward = self.backward
        for pending in (backward.replica_reduce, *backward.pending_reduces):
            if pending is not None:
                pending.discard()
        backward.pending_reduces, backward.replica_reduce = [], None
        if backward.handle is not None:  # finalize_backward(async_op=True)'s
            backward.handle.invalidate()
            backward.handle = None
        self.copies.settle()
        for group in self.members:
            group.reshard()
            group.forget_backward()
        for presence in backward.unknown_presence:
            for p, _ in presence.missing:
                p.presence_unknown = False
        backward.unknown_presence = []
        for u in self.units:
            u.explicit_unshard = False
        backward.forget()
        self.order.forget_recording()
        self.start_iteration()

    def reduce_options(self, group: ParamGroup) -> ReduceOptions:
        """The gradient-reduction settings of ``group``'s units; with several units (a
        list or merged small units) the others agree by construction except for the
        run-time toggle ``all_reduce``, which holds while any of them asks for it."""
        members = self.members[group]
        first = members[0].reduce_options
        if len(members) == 1:
            return first
        changes = {}
        if not first.all_reduce and any(u.reduce_options.all_reduce for u in members[1:]):
            changes["all_reduce"] = True
        if not first.unused_as_zeros and any(u.reduce_options.unused_as_zeros
                                             for u in members[1:]):
            changes["unused_as_zeros"] = True
        return dataclasses.replace(first, **changes) if changes else first

    def unshards_in_backward(self, group: ParamGroup) -> bool:
        return any(u.unshard_in_backward for u in self.members[group])

    # -- reduce-scatters in flight ----------------------------------------------------------
    # Note [reductions in flight]
    # A reduction holds its send buffer until it is finished, and finishing waits for its
    # collective: on CUDA the compute stream then waits for the reduce-scatter before the
    # next unit's gradients are laid out. By default one reduction is in flight: the next
    # unit's reduction first finishes the one before. With
    # ``set_reduce_scatter_max_input_buffers(n)`` (torch's name for the same dial) up to
    # ``n`` stay in flight and the oldest is finished when the (n+1)-th starts: a
    # reduce-scatter slower than the backward it hides behind no longer stalls compute, at
    # the memory of n send buffers. They are finished in the order they were issued, the
    # same on every rank, and all of them at the end of backward (or when left in flight
    # by ``set_is_last_backward(False)``, before the next forward, backward or step), so
    # the gradients are the same whatever ``n``. The root keeps the largest ``n`` of its
    # groups', as torch's FSDP2 keeps one per communication context.
    def update_reduces_in_flight(self) -> None:
        """Read the groups' ``set_reduce_scatter_max_input_buffers`` settings again."""
        self.reduces_in_flight = max((g.comm_options.reduces_in_flight for g in self.members),
                                     default=1)

    def finish_pending_reduce(self, everything: bool = True) -> None:
        """Finish the reductions in flight; with ``everything`` False only those beyond the
        ones the next reduction may leave in flight (Note [reductions in flight]), and a
        hybrid-sharded one only moves on to its all-reduce across replicas, which the next
        call finishes (Note [the replica all-reduce in flight])."""
        backward = self.backward
        earlier, backward.replica_reduce = backward.replica_reduce, None
        pending = backward.pending_reduces
        keep = 0 if everything else self.reduces_in_flight - 1
        while len(pending) > keep:
            oldest = pending.pop(0)
            if not everything and oldest.start_replica_reduce(self.patience):
                # the earlier all-reduce is finished once the next one has started
                self._finish(earlier)
                self._finish(backward.replica_reduce)
                earlier, backward.replica_reduce = None, oldest
            else:
                self._finish(earlier)
                earlier = None
                self._finish(oldest)
        self._finish(earlier)

    def _finish(self, reduction: PendingReduce | None) -> None:
        if reduction is None:
            return
        unknown = reduction.finish(self.patience)
        if unknown is not None:
            self.backward.unknown_presence.append(unknown)
        listener = self.backward.on_reduced
        if listener is not None and reduction.handed_out:
            listener(reduction.params, unknown is None)

    def use_copies(self, shared: SharedCopies) -> None:
        """Move every group's host<->device copies to ``shared``'s streams (after the
        copies in flight on the current ones have landed)."""
        if getattr(self, "copies", None) is not None:
            self.copies.settle()
        first = next(iter(self.members), None)
        self.copies = shared.for_device(first.compute_device if first is not None
                                        else torch.device(self.unit.mesh.device_type))
        for group in self.members:
            group.copies = self.copies

    def settle_gradients(self) -> None:
        """Finish the reduction in flight and wait for gradients still being copied to the
        host: afterwards every ``.grad`` holds its final value."""
        self.finish_pending_reduce()
        # the ranks agreed on what they reduced (or it raises). Only after a backward:
        # optimizer.step() settles every live root, and a model no longer used may be
        # collected on one rank and not yet on another; a check on some ranks only would
        # pair with another model's on the rest. Before the copies to the host: their
        # wait would hold a diverged rank behind an unmatched collective on the device
        # (Note [a comparison one step behind]).
        backward = self.backward
        if self.guard is not None and backward.ended_since_settle:
            self.guard.compare(BACKWARD, at_once=self.copies.in_flight)
        backward.ended_since_settle = False
        self.copies.settle()
        unknown, backward.unknown_presence = backward.unknown_presence, []
        resolve_all(unknown)  # after the copies: offloaded flags are on the host now
