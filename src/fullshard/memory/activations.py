"""Activation memory, measured by running one training step on the meta device.

Note [activations are traced, not derived by formula]
A formula per architecture (``34 * s * b * h + 5 * a * s^2 * b`` and the like)
holds for the model it was derived for and drifts as soon as a model adds a gate,
a norm, rotary embeddings or a different loss. Instead the estimator runs the
model's real forward and backward once on the meta device (shapes and dtypes, no
data, no memory) under a dispatch mode that sees every tensor an op creates and,
through a weak reference to its storage, the moment it is freed. The live bytes
between two events are exactly what autograd keeps for backward plus the
temporaries of the op in flight, for any ``nn.Module`` (a Hugging Face model
included), with or without activation checkpointing (the recomputation in
backward is traced too). Parameters, buffers and the inputs were created before
the trace and are not counted; a parameter's gradient is reported as an event and
taken out of the activation count, because fullshard decides when it is freed.

Events are recorded at the moments fullshard acts: a unit's forward starting and
ending, its backward starting (first gradient reaching its outputs), its inputs'
gradients being computed (signalled by fullshard's own watch,
``core.hooks.watch_input_grads``, so that it comes before the previous unit's
backward starts, as at run time), and each parameter's gradient being accumulated.
The ``replay`` module lays fullshard's buffers over this sequence.

One substitution keeps the trace faithful: on the meta device
``scaled_dot_product_attention`` takes its math path, which keeps the
``seq x seq`` attention matrix for backward; the kernels used on CPU and CUDA
(flash / memory-efficient) keep the output and its log-sum-exp. Unmasked calls are
traced through ``_scaled_dot_product_flash_attention_for_cpu``, whose saved
tensors match those kernels.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ..core.hooks import watch_input_grads
from .allocator import MMAP_THRESHOLD_BYTES

# Note [freed small blocks stay resident]
# On CPU, glibc serves blocks below the mmap threshold from its heap and
# keeps them resident after they are freed (only the heap's top is returned). So
# for peak RSS the activations held in small storages count at their high-water
# mark for the rest of the step, not at their live size; replay.py adds the
# difference when estimating for the CPU. The estimate assumes the threshold that
# tune_cpu_allocator() fixes (memory/allocator.py); without it glibc's threshold
# floats up to 32 MiB and more freed memory stays resident than estimated.
SMALL_BYTES = MMAP_THRESHOLD_BYTES


@dataclass(frozen=True)
class Event:
    """One moment fullshard acts on, with the activation bytes around it.

    ``kind``: pre_forward, post_forward, forward_end (the loss is computed),
    pre_backward, inputs_ready (a unit's input gradients are computed), grad (a
    parameter's gradient was accumulated), backward_end. ``subject``: a unit index, or a parameter key for ``grad``.
    ``live``: activation bytes alive at the event; ``peak_after``: the most alive
    at any moment between this event and the next; ``small_live``: the part of
    ``live`` in storages below ``SMALL_BYTES`` (Note [freed small blocks stay resident]).
    """

    kind: str
    subject: int
    live: int
    peak_after: int
    small_live: int = 0


@dataclass
class StepTrace:
    """The events of one forward + backward, and what each unit saw."""

    events: list[Event] = field(default_factory=list)
    forward_order: list[int] = field(default_factory=list)   # units by first pre-forward
    watched_inputs: dict[int, int] = field(default_factory=dict)  # unit -> forwards with
    # inputs that require grad (each one's input gradients arrive once in backward)
    saved_at_forward_end: int = 0  # activation bytes alive when backward starts
    small_peak: int = 0  # most bytes alive at once in storages below SMALL_BYTES


class _LiveStorages(TorchDispatchMode):
    """Bytes of storages created by ops, from creation until freed."""

    def __init__(self, external: set[int]):
        super().__init__()
        self.external = external     # ids of storages that existed before the trace
        self.live = 0
        self.peak = 0                # since the last call to ``restart_peak``
        self.small_live = 0          # part of ``live`` in storages below SMALL_BYTES
        self.small_peak = 0
        self._refs: dict[int, tuple[weakref.ref, int]] = {}
        self._not_activations: set[int] = set()  # storages that became parameter grads

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._track(t.untyped_storage())
        self.peak = max(self.peak, self.live)
        return out

    def _track(self, storage: torch.UntypedStorage) -> None:
        key = id(storage)
        if key in self.external:
            return
        known = self._refs.get(key)
        if known is not None and known[0]() is storage:
            return
        nbytes = storage.nbytes()
        self._refs[key] = (weakref.ref(storage, lambda _r, k=key: self._freed(k)), nbytes)
        self._add(nbytes, 1)

    def _add(self, nbytes: int, sign: int) -> None:
        self.live += sign * nbytes
        if nbytes < SMALL_BYTES:
            self.small_live += sign * nbytes
            self.small_peak = max(self.small_peak, self.small_live)

    def _freed(self, key: int) -> None:
        _ref, nbytes = self._refs.pop(key)
        if key in self._not_activations:
            self._not_activations.discard(key)
        else:
            self._add(nbytes, -1)

    def not_an_activation(self, tensor: torch.Tensor) -> None:
        """Stop counting ``tensor``'s storage (a parameter gradient)."""
        key = id(tensor.untyped_storage())
        if key in self._refs and key not in self._not_activations:
            self._not_activations.add(key)
            self._add(self._refs[key][1], -1)

    def restart_peak(self) -> None:
        self.peak = self.live


@contextlib.contextmanager
def _fused_attention() -> Iterator[None]:
    """Route unmasked SDPA to a fused kernel's op (see the module note) while tracing.

    ``F.scaled_dot_product_attention`` itself is swapped, not intercepted with a
    TorchFunctionMode: activation checkpointing recomputes in backward, where such a
    mode is not active, and the recomputation must save what the forward saved."""
    original = F.scaled_dot_product_attention

    def fused_or_original(*args, **kwargs):
        fused = _fused_sdpa(*args, **kwargs)
        return fused if fused is not None else original(*args, **kwargs)

    F.scaled_dot_product_attention = fused_or_original
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original


def _fused_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                scale=None, enable_gqa=False):
    if enable_gqa and key.shape[-3] != query.shape[-3]:  # grouped-query attention
        repeats = query.shape[-3] // key.shape[-3]  # (a GQA kernel keeps k, v unrepeated:
        key = key.repeat_interleave(repeats, -3)    # these copies are a small overcount)
        value = value.repeat_interleave(repeats, -3)
    if attn_mask is not None or query.shape[-3] != key.shape[-3]:
        return None  # the math path keeps what it keeps: counted as is (conservative)
    out, _lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, dropout_p, is_causal, scale=scale)
    return out


class _Recorder:
    """Module and autograd hooks that turn fullshard's moments into events."""

    def __init__(self, units: list[nn.Module], mode: _LiveStorages, trace: StepTrace):
        self.units = units
        self.mode = mode
        self.trace = trace
        self.in_backward = False
        self._started_backward: set[int] = set()
        self._grads_seen: set[int] = set()
        self._handles: list[Any] = []

    def event(self, kind: str, subject: int) -> None:
        events = self.trace.events
        if events:  # close the previous event's interval
            last = events[-1]
            events[-1] = Event(last.kind, last.subject, last.live, self.mode.peak)
        events.append(Event(kind, subject, self.mode.live, self.mode.live,
                            self.mode.small_live))
        self.mode.restart_peak()

    def install(self, params: list[nn.Parameter]) -> None:
        for index, unit in enumerate(self.units):
            self._handles.append(unit.register_forward_pre_hook(
                lambda m, a, k, i=index: self._pre_forward(i, a, k), with_kwargs=True))
            self._handles.append(unit.register_forward_hook(
                lambda m, a, k, out, i=index: self._post_forward(i, out), with_kwargs=True))
        for p in params:
            if p.requires_grad:
                self._handles.append(p.register_post_accumulate_grad_hook(self._grad))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()

    def _pre_forward(self, unit: int, args: Any, kwargs: Any) -> Any:
        if self.in_backward:  # activation-checkpoint recomputation: traced, not an event
            return None
        if unit not in self.trace.forward_order:
            self.trace.forward_order.append(unit)
        self.event("pre_forward", unit)
        if not torch.is_grad_enabled():
            return None
        # fullshard's own watch: one signal per forward call, ordered as at run time
        watch = _InputGrads(self, unit)
        args, kwargs = watch_input_grads(watch, args, kwargs)
        if watch.watched:
            self.trace.watched_inputs[unit] = self.trace.watched_inputs.get(unit, 0) + 1
        return args, kwargs

    def _post_forward(self, unit: int, output: Any) -> None:
        if self.in_backward:
            return
        self.event("post_forward", unit)
        for t in tree_flatten(output)[0]:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(lambda _g, i=unit: self._pre_backward(i))

    def _pre_backward(self, unit: int) -> None:
        self.in_backward = True
        if unit not in self._started_backward:
            self._started_backward.add(unit)
            self.event("pre_backward", unit)

    def _grad(self, param: nn.Parameter) -> None:
        self.mode.not_an_activation(param.grad)
        if id(param) not in self._grads_seen:
            self._grads_seen.add(id(param))
            self.event("grad", id(param))


class _InputGrads:
    """What ``watch_input_grads`` signals to: a unit's input gradients are computed."""

    def __init__(self, recorder: _Recorder, unit: int):
        self.recorder = recorder
        self.unit = unit
        self.watched = False
        self.unwatched_calls = 0  # the runtime's count; the trace reads ``watched``

    def watch_started(self) -> None:
        self.watched = True

    def watch_dropped(self) -> None:
        pass  # the traced graph is always backpropagated

    def input_grads_ready(self) -> None:
        self.recorder.event("inputs_ready", self.unit)


def trace_step(model: nn.Module, units: list[nn.Module],
               loss_of: Callable[[nn.Module], torch.Tensor]) -> StepTrace:
    """Run ``loss_of(model).backward()`` on the meta device and record its events.

    ``units`` are the modules fullshard would shard (the root last); ``loss_of``
    builds its inputs on the meta device and returns the scalar loss.
    """
    params = list(model.parameters())
    external = {id(t.untyped_storage()) for t in [*params, *model.buffers()]}
    trace = StepTrace()
    mode = _LiveStorages(external)
    recorder = _Recorder(units, mode, trace)
    recorder.install(params)
    try:
        with _fused_attention(), mode:
            loss = loss_of(model)
            recorder.event("forward_end", -1)
            trace.saved_at_forward_end = mode.live
            loss.backward()
            del loss
            recorder.event("backward_end", -1)
        trace.small_peak = mode.small_peak
    finally:
        recorder.remove()
        recorder.in_backward = False
        for p in params:
            p.grad = None
    return trace
