"""Module and autograd hooks: when each unit gathers, frees and reduces.

Forward:  pre-forward gathers the unit (waiting on a prefetch if one was issued),
          then prefetches the unit that ran next in the previous iteration;
          post-forward frees the unit (``reshard_after_forward``; the root only if asked)
          and hooks the outputs so backward can gather it again.
Backward: an output-gradient hook gathers the unit and prefetches the unit that
          ran before it in forward; once the gradients of the unit's forward inputs
          are computed (its module's backward is over), the unit reduce-scatters
          asynchronously and frees its parameters. A final callback, queued when
          backward starts, reduces the units whose inputs needed no gradient, in one
          fixed order, checks that every rank did the same (core/guard/divergence.py) and
          leaves everything sharded. See Note [when a unit's backward is done].

Note [when a unit's backward is done]
A unit's backward is over when its module's backward is over: every forward call's
inputs that require grad pass through an identity autograd function
(``_InputGradsReady``, in the form torch.func accepts; outside its transforms a
context-style twin, which torch applies without binding the arguments' signature)
whose backward runs once their gradients are computed; when
every watched call of this iteration has fired, nothing of this backward reads the
unit's parameters again (frozen weights included: a LoRA layer's input gradient reads
the frozen base weight after the adapters' gradients are done), and its parameters'
gradients are in: AccumulateGrad nodes run ahead of every other ready node (their
sequence number is the largest), and a parameter's gradient is computed no later
than the gradient of the input it was combined with. A gradient that still arrives
after its unit was reduced (a parameter also used by a module that runs before the
unit: a trait of the model) is looked for at the final callback of the first two
backward passes and of every 16th, and named.

The signal depends on which modules ran, never on which parameters got gradients,
so every rank reduces the same units in the same order whatever its data: an expert
that got no tokens on one rank, a branch taken on some ranks only (Note [ranks agree
on every collective]); its parameters are reduced as zeros there (Note [gradient
presence flags]). This is torch FSDP2's module-boundary signal. An earlier design
counted AccumulateGrad hooks, which made a unit with an unused parameter wait for
the final callback on one rank while the others reduced it in place: different
orders on different ranks.

A unit whose forward inputs need no gradient (token ids), or that was called once
without such inputs, has no boundary signal: it is reduced in the final callback, in
``root.units`` order on every rank. A watched call whose graph is freed without a
backward (a forward with grad, then no backward) stops counting then; one whose graph
is kept alive across the backward of another forward holds its unit's reduction (and
gathered parameters) to the final callback, as the graph holds its activations.
Reentrant activation checkpointing runs the forward without grad and backpropagates
through the recomputation: the recomputed call is watched instead.

A graph can be backpropagated twice (``loss.backward(retain_graph=True)``, then again):
its watches fired in the first backward and do not fire again, so the second backward
reduces the units of that graph in its final callback. Until a forward with grad builds
another graph, the units the last backward covered are still expected (they stay in
``BackwardState.ran_with_grad``); the gradients of the second backward add to the
reduced ones, as in one process. Without that they stayed on the unsharded parameters and were
reduced with the next step's. A kept graph whose watches did not all fire (two losses
of one forward, backpropagated one at a time) also keeps its unwatched calls counting
after the first backward: the second waits for their gradients in its final callback
instead of reducing when the remaining watches fire.

Note [a backward that creates a graph]
``torch.autograd.grad(out, x, create_graph=True)`` (a gradient penalty) or
``backward(create_graph=True)`` builds a graph of the backward itself, and that graph
reads the gathered parameters: freeing them after the backward, as usual, made the next
backward through it fail deep in autograd ("setStorage: ... storage of size 0"), as it
does with torch's FSDP2. The engine runs such a backward in grad mode, which the first
pre-backward hook sees; that backward then leaves every group gathered. The backward
through the new graph reduces and reshards as usual; a group nothing backpropagates
through again is resharded by the next forward (its values may be stale after an
optimizer step, unlike ``set_reshard_after_backward(False)``'s, which are kept).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
import torch.nn as nn
from torch.autograd import Variable

from .containers import flatten, unflatten
from .guard.divergence import DivergenceError, Guard, debug_enabled, guarded
from .guard.structure import describe
from .group import GroupState, ParamGroup
from .init import lazy_init
from .refusals.load_check import own_hook
from .guard.ledger import BACKWARD, Ledger, unit_code
from .schedule import BackwardSignals
from .state import RootState, UnitState, units_in


def install(unit: UnitState) -> None:
    """Register the forward hooks and the state-dict hooks of ``unit.module``.

    Note [hooks under torch.compile]
    The hooks run eagerly even inside a compiled model: ``torch._dynamo.disable`` makes
    Dynamo break the graph around each of them (what FSDP2 does by default, its
    ``skip_fsdp_hooks``). They mutate storage sizes, issue collectives and keep Python
    state; tracing them would bake one iteration's decisions into the graph. A block
    compiled before ``fully_shard`` is one graph between the hooks; a model compiled
    after it has a graph per stretch of computation between two units' hooks.
    What autograd calls back in backward is disabled too (the input watch's backward, the
    final callback): a backward run from a compiled function (``torch.compile`` of a
    step that calls ``loss.backward()``) runs with Dynamo's frame hook still set, and
    Dynamo would otherwise try to trace fullshard's reductions. torch's own hooks escape
    this by living in files Dynamo skips.
    """
    unit.module.register_forward_pre_hook(torch._dynamo.disable(partial(_pre_forward, unit)),
                                          prepend=True, with_kwargs=True)
    unit.module.register_forward_hook(torch._dynamo.disable(partial(_post_forward, unit)),
                                      always_call=False, with_kwargs=True)
    unit.pre_backward_hook = torch._dynamo.disable(partial(_pre_backward, unit))
    _install_state_dict_hooks(unit)


def _install_state_dict_hooks(unit: UnitState) -> None:
    """state_dict()/load_state_dict() always see the sharded DTensors; a load with
    ``assign=True`` re-points the new DTensors at the unit's flat shard.

    A unit's group is its own for life (Note [buckets: units gather together]): a unit
    in a batch reshards through its group, which reshards the batch, and re-points the
    loaded parameters at its own flat shard, which the batch's gather copies in."""
    if unit.group is None:
        return

    @own_hook
    def to_sharded(*_args, **_kwargs) -> None:
        unit.group.reshard()

    def readopt(*_args, **_kwargs) -> None:
        with torch.no_grad():
            unit.group.readopt()

    unit.module.register_state_dict_pre_hook(to_sharded)
    unit.module.register_load_state_dict_pre_hook(to_sharded)
    unit.module.register_load_state_dict_post_hook(readopt)


def ensure_root(unit: UnitState) -> RootState:
    """Lazy init: the first unit to run (forward or ``unshard()``) becomes the root."""
    if unit.root is not None:
        return unit.root
    units = units_in(unit.module)
    names = {m: n for n, m in unit.module.named_modules()}
    for u in units:
        u.rename(names[u.module])
    root = lazy_init(unit, units, unit.bucket_numel)
    ranks = unit.mesh.mesh.flatten().tolist()
    if guarded(ranks):  # Note [ranks agree on every collective]
        # where the host runs ahead of the device, a comparison one step behind
        root.guard = Guard(Ledger([u.name for u in root.units]), ranks,
                           debug_enabled(unit.debug), lambda: root.backward.running,
                           lagged=unit.mesh.device_type != "cpu")
        root.guard.agree_on_model(describe(root.units), unit.name)  # Note [ranks shard the same model]
    for u in root.units:
        u.ledger_code = unit_code(u.name)
    for group, members in root.members.items():
        group.signals.on_done = partial(_on_backward_done, root, group)
        group.guard = root.guard
        group.guard_unit = members[0].ledger_code
    return root


# -- forward ----------------------------------------------------------------------------
def run_pre_forward(unit: UnitState, args: Any, kwargs: Any) -> tuple[Any, Any]:
    """What happens before ``unit.module``'s forward, for other forward-like methods;
    returns the (possibly cast) args and kwargs."""
    cast = _pre_forward(unit, unit.module, args, kwargs)
    return cast if cast is not None else (args, kwargs)


def run_post_forward(unit: UnitState, args: Any, kwargs: Any, output: Any) -> Any:
    """What happens after ``unit.module``'s forward, for other forward-like methods;
    returns the (possibly cast) output."""
    return _post_forward(unit, unit.module, args, kwargs, output)


def _pre_forward(unit: UnitState, module: nn.Module, args: Any, kwargs: Any) -> Any:
    root = ensure_root(unit)
    group = unit.batch
    backward = root.backward
    if backward.running:  # activation-checkpoint recompute: parameters are needed again
        if group is not None:
            group.unshard()
            group.wait_unshard()
        # reentrant checkpointing backpropagates through this recomputation (the forward
        # ran without grad): watch it; otherwise cast only (Note [when a unit's backward
        # is done])
        recomputed = (group is not None and torch.is_grad_enabled()
                      and unit not in backward.ran_with_grad)
        if recomputed:
            backward.recomputed.add(unit)
        return _prepare_inputs(unit, group.signals if recomputed else None, args, kwargs)
    if unit is root.unit:
        _check_input_devices(unit, args, kwargs)
        _root_pre_forward(root)
    if root.guard is not None:
        root.guard.forward(unit.ledger_code)
    root.record_pre_forward(unit)
    if group is not None:
        group.unshard()
        group.wait_unshard()
    unit.explicit_unshard = False
    _prefetch(root, [c.batch for c in unit.companions])
    if unit.forward_prefetch is not None:
        _prefetch(root, _groups_of(unit.forward_prefetch))
    else:
        _prefetch(root, [root.next_group_in_forward(unit)])
    watched = group.signals if group is not None and torch.is_grad_enabled() else None
    return _prepare_inputs(unit, watched, args, kwargs)


def _prepare_inputs(unit: UnitState, watched: BackwardSignals | None, args: Any, kwargs: Any
                    ) -> tuple[Any, Any] | None:
    """The inputs cast to ``param_dtype`` and watched for their gradients
    (``watch_input_grads``; not when ``watched`` is None) in one pass, or None to keep them: this runs
    before every unit's forward, so the usual call, positional tensors only, skips
    pytree (flattening twice was a third of the hook's time on small units)."""
    policy = unit.mp_policy
    dtype = policy.param_dtype if policy.cast_forward_inputs else None
    if dtype is None and watched is None:
        return None
    if not kwargs and all(type(a) is torch.Tensor for a in args):
        leaves, spec = list(args), None
    else:
        leaves, spec = flatten((args, kwargs))
    changed = False
    if dtype is not None:
        for i, t in enumerate(leaves):
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != dtype:
                leaves[i], changed = t.to(dtype), True
    if watched is not None:
        changed = _watch(watched, leaves) or changed
    if not changed:
        return None
    return (tuple(leaves), kwargs) if spec is None else unflatten(leaves, spec)


def _watch(signals: BackwardSignals, leaves: list) -> bool:
    """Pass the leaves that require grad through _InputGradsReady (in place); whether any
    did. A call with none is counted unwatched (Note [when a unit's backward is done])."""
    slots = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not slots:
        signals.unwatched_calls += 1
        return False
    # torch binds an autograd.Function's arguments through inspect.signature at every
    # apply when it defines setup_context (three times the whole call on a small unit):
    # outside torch.func's transforms, which need that form, the context-style twin runs
    ready = (_InputGradsReady if torch._C._are_functorch_transforms_active()
             else _InputGradsReadyEager)
    watched = ready.apply(_Watch(signals), *(leaves[i] for i in slots))
    for i, t in zip(slots, watched):
        leaves[i] = t
    return True


class _Watch:
    """One watched forward call: fires once when its inputs' gradients are computed, or
    stops counting when its graph is freed without a backward through it. A watch made
    before the group forgot its backward (``reset_iter_state``) no longer counts."""

    __slots__ = ("signals", "fired", "epoch")

    def __init__(self, signals: BackwardSignals):
        self.signals = signals
        self.fired = False
        self.epoch = getattr(signals, "epoch", 0)
        signals.watch_started()

    def _counts(self) -> bool:
        if self.fired:  # a second backward through a retained graph: not counted
            return False
        self.fired = True
        return self.epoch == getattr(self.signals, "epoch", 0)

    def fire(self) -> None:
        if self._counts():
            self.signals.input_grads_ready()

    def __del__(self) -> None:
        if self._counts():
            self.signals.watch_dropped()


def _check_input_devices(unit: UnitState, args: Any, kwargs: Any) -> None:
    """Catch inputs that cannot meet the gathered parameters before torch fails deep
    inside a layer: meta tensors, tensors on another accelerator, and floating-point
    tensors on the CPU for a model computing elsewhere (integer CPU tensors such as
    sequence lengths are legitimate inputs to CUDA models)."""
    device_type = unit.mesh.device_type
    leaves = _leaves_of((args, kwargs) if kwargs else args)
    for i, t in enumerate(leaves):
        if not isinstance(t, torch.Tensor) or t.device.type == device_type:
            continue
        if t.is_meta or t.device.type != "cpu" or t.is_floating_point():
            raise ValueError(
                f"fullshard: input #{i} of {unit.name} (shape {tuple(t.shape)}, {t.dtype}) is "
                f"on {t.device} but the model computes on {device_type}; move the batch there "
                f"first (e.g. batch.to('{device_type}')).")


class _InputGradsReadyEager(torch.autograd.Function):
    """Identity on a unit's forward inputs whose backward runs once their gradients are
    computed, i.e. once the unit's backward no longer needs its parameters. It takes its
    context in forward, which torch applies without binding the arguments' signature
    first; torch.func refuses that form, so under its transforms ``_InputGradsReady``
    runs instead."""

    @staticmethod
    def forward(ctx, watch, *tensors):
        ctx.watch = watch
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    @torch._dynamo.disable  # Note [hooks under torch.compile]
    def backward(ctx, *grads):
        ctx.watch.fire()
        return (None, *grads)


class _InputGradsReady(_InputGradsReadyEager):
    """The same identity in the form torch.func accepts (``setup_context``, ``jvp``), so a
    unit runs inside ``torch.func.jvp``: forward-mode passes the tangents through, as the
    identity does. Its backward is the eager form's."""

    @staticmethod
    def forward(watch, *tensors):
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.watch = inputs[0]

    @staticmethod
    def jvp(ctx, _watch_tangent, *tangents):
        return tuple(t.view_as(t) for t in tangents)


def watch_input_grads(signals: BackwardSignals, args: Any, kwargs: Any) -> Any:
    """(args, kwargs) with the tensors that require grad passed through _InputGradsReady:
    ``signals.watch_started()`` runs now, ``signals.input_grads_ready()`` once their
    gradients are computed, before the gradient reaches any hook on the tensors
    themselves (the previous unit's pre-backward), or ``signals.watch_dropped()`` when
    the graph is freed first. The memory estimator's trace (memory/activations.py)
    watches with a stand-in of its own (anything with those three and
    ``unwatched_calls``), so its events come in the runtime's order."""
    leaves, spec = flatten((args, kwargs))
    if not _watch(signals, leaves):
        return args, kwargs
    return unflatten(leaves, spec)


def _cast_floats(tree: Any, dtype: torch.dtype) -> Any:
    leaves, spec = flatten(tree)
    return unflatten([t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point()
                      else t for t in leaves], spec)


def _groups_of(units: list[UnitState]) -> list[ParamGroup | None]:
    """The batches gathering ``units`` gathers, their companions' included."""
    return [u.batch for unit in units for u in unit.gathered_together()]


def _prefetch(root: RootState, groups: list[ParamGroup | None]) -> None:
    """Start gathering each group that is sharded and not yet done with this backward."""
    for group in groups:
        if group is not None and group.state is GroupState.SHARDED \
                and group not in root.backward.reduced \
                and (not root.backward.running or root.unshards_in_backward(group)):
            group.unshard(async_op=True)


def _root_pre_forward(root: RootState) -> None:
    root.settle_gradients()
    event, root.unit.post_optim_event = root.unit.post_optim_event, None
    if event is not None:  # set_post_optim_event: gathers wait for the optimizer step
        event.wait()
    # Parameters still gathered from an earlier forward without backward may be stale
    # after an optimizer step: gather them again. Those the user just gathered or asked
    # to keep across backward (set_reshard_after_backward(False)) are kept while their
    # shard was not written since (Note [parameters kept gathered across backward]).
    fresh = {u.batch for u in root.units if u.explicit_unshard}
    for group in root.members:
        if group.state is GroupState.SHARDED:
            continue
        group.finish_host_step_read()  # a step still running has not yet raised the version
        if group not in fresh and group.state is not GroupState.KEPT:
            group.reshard()  # the same on every rank
        elif group.shard_written_since_gathered():
            group.reshard_stale()  # this rank's own finding
    root.start_iteration()
    if root.guard is not None:
        root.guard.ledger.step += 1


def _post_forward(unit: UnitState, module: nn.Module, args: Any, kwargs: Any,
                  output: Any) -> Any:
    root = unit.root
    if unit.mp_policy.output_dtype is not None:
        output = _cast_floats(output, unit.mp_policy.output_dtype)
    if root.backward.running:
        return output
    group = unit.batch
    if torch.is_grad_enabled():
        root.record_post_forward(unit)
        root.backward.forward_with_grad(unit)
        _hook_outputs(unit, output)
        if group is not None and unit.reshards_after_forward and root.forward_finished(unit):
            group.reshard_after_forward()
    elif group is not None and root.forward_finished(unit):
        group.reshard()  # no backward will read these parameters
    if unit is root.unit and root.guard is not None:  # the forward is over: compare
        _check_forward(root)
    return output


def _check_forward(root: RootState) -> None:
    """Note [ranks agree on every collective]: a forward without grad has no backward to
    check it, so it is compared now; one with grad is by its backward."""
    if not torch.is_grad_enabled():
        root.guard.compare(root.guard.phase())


def _leaves_of(tree: Any) -> list:
    """The leaves of a unit's inputs or outputs. This runs around every unit's forward:
    the usual trees, a tensor or a tuple of tensors, are their own leaves without a call
    into pytree, and only other trees go through containers.flatten, which also opens
    dataclasses (Note [dataclasses between units])."""
    if type(tree) is torch.Tensor:
        return [tree]
    if type(tree) is tuple and all(type(t) is torch.Tensor for t in tree):
        return list(tree)
    return flatten(tree)[0]


def _hook_outputs(unit: UnitState, output: Any) -> None:
    for t in _leaves_of(output):
        if isinstance(t, torch.Tensor) and t.requires_grad:
            t.register_hook(unit.pre_backward_hook)


# -- backward ---------------------------------------------------------------------------
def _pre_backward(unit: UnitState, grad: torch.Tensor) -> None:
    root = unit.root
    if not root.backward.running:
        _start_backward(root)
    group = unit.batch
    if group is not None and group not in root.backward.reduced \
            and root.unshards_in_backward(group):
        group.unshard()
        group.wait_unshard()
    _prefetch(root, [c.batch for c in unit.companions])
    if unit.backward_prefetch is not None:
        _prefetch(root, _groups_of(unit.backward_prefetch))
    elif not unit.backward_prefetch_after_grads:
        _prefetch(root, [root.prev_group_in_forward(unit)])
    return None


def _start_backward(root: RootState) -> None:
    if torch._dynamo.compiled_autograd.in_compiled_autograd_region:
        # the traced backward calls the hooks, but the reductions they start never reach
        # the sharded gradients: every step would silently leave the weights as they were
        raise NotImplementedError(
            f"fullshard: the backward through {root.unit.name} runs under compiled "
            "autograd (torch._dynamo.config.compiled_autograd), which fullshard's gradient "
            "reduction does not support. Turn compiled autograd off; torch.compile of the "
            "model or of its blocks works with fullshard (Note [hooks under torch.compile]).")
    root.backward.running = True
    # create_graph=True runs the backward in grad mode (Note [a backward that creates a
    # graph])
    root.backward.creates_graph = torch.is_grad_enabled()
    Variable._execution_engine.queue_callback(
        torch._dynamo.disable(partial(_final_callback, root)))


def _on_backward_done(root: RootState, group: ParamGroup) -> None:
    backward = root.backward
    if backward.running and group not in backward.reduced and group.signals.done:
        _post_backward(root, group)


def _post_backward(root: RootState, group: ParamGroup) -> None:
    root.finish_pending_reduce(everything=False)  # Note [reductions in flight]
    group.finish_host_step_read()  # its host step may still read the gradients about to be written
    if not (root.stays_gathered_after_backward(group) or root.backward.creates_graph):
        group.reshard()  # free the parameters before the reduce allocates its buffers
    first = root.members[group][0]
    if first.backward_prefetch is None and first.backward_prefetch_after_grads:
        _prefetch(root, [root.prev_group_in_forward(first)])
    if any(u.requires_gradient_sync for u in root.members[group]):
        reduction = group.grads.reduce(root.reduce_options(group))
        if reduction is not None:
            root.backward.pending_reduces.append(reduction)
    else:  # accumulate unsharded until a backward with gradient sync reduces it all
        group.grads.accumulate_unsharded()
    root.backward.reduced.add(group)


def _final_callback(root: RootState) -> None:
    backward = root.backward
    backward.passes += 1
    backward.ended_since_settle = True
    # before the final reductions take more gradients; a parameter used outside its unit
    # is a trait of the model, so a few backward passes and then every 16th show it
    late = (_late_gradients(root) if backward.passes <= 2 or backward.passes % 16 == 0
            or (root.guard is not None and root.guard.debug) else None)
    for u in root.units:  # units without a boundary signal, in one order on every rank
        group = u.batch
        if group is None or group in backward.reduced:
            continue
        if backward.expects_gradients(u) or (
                root.reduce_options(group).unused_as_zeros and group.unsharded.built):
            _post_backward(root, group)
    if late:
        if root.guard is not None:
            root.guard.ensure_agreed(BACKWARD)
        raise DivergenceError(late)
    if root.unit.is_last_backward and not root.unit.manual_backward_finalization:
        root.settle_gradients()
    # else: the last reduce-scatter overlaps whatever comes next; the next backward,
    # forward or optimizer step completes it first (set_is_last_backward(False))
    for group in root.members:
        group.signals.end_backward()
        if root.stays_gathered_after_backward(group):
            group.keep_for_next_forward()
        elif not backward.creates_graph:  # else gathered until the next forward reshards
            group.reshard()
    backward.end()


def _late_gradients(root: RootState) -> str | None:
    """A gradient that reached a unit's parameter after the unit was reduced (Note [when
    a unit's backward is done]): named, never dropped or carried into the next step."""
    for group in root.backward.reduced:
        if not any(u.requires_gradient_sync for u in root.members[group]):
            continue  # accumulating without sync: its gradients stay on the parameters
        for p in group.trainable():
            up = p.unsharded_param
            if up is not None and up.grad is not None:
                return (f"fullshard: parameter '{p.fqn}' of {group.unit_name} received a "
                        "gradient after the unit's backward was over (its input gradients "
                        "were already computed): the parameter is also used outside the "
                        "unit's forward, by a module that runs before it. Shard the modules "
                        "that share it in one fully_shard call, or in a unit that contains "
                        "both.")
    return None
