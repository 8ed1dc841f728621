"""Live memory report: each phase's peak per rank, next to fullshard's own buffers.

Usage (one tracker per rank, created before the model so that its baseline is the
process alone)::

    tracker = MemoryTracker(warm_up=True)  # every rank; baseline: RSS on CPU, allocated on CUDA
    model = build_and_shard(...)
    tracker.watch(model)                   # optional: fullshard's buffers per phase
    for batch in loader:
        with tracker.phase("forward"):
            loss = loss_fn(model(batch))
        with tracker.phase("backward"):
            loss.backward()
        with tracker.phase("optimizer"):
            optim.step(); optim.zero_grad()
        report = tracker.step_report()     # dict, see ``step_report``

On CUDA a phase's peak is ``torch.cuda.max_memory_allocated`` after resetting the
peak at the phase's start. The caching allocator counts on the host, when a tensor is
created or freed, so phases need no device synchronization (a synchronization at each
phase boundary would drain the queue of kernels every time: a trainer step would wait
for the device six times); on CPU it is the peak RSS (``VmHWM``), reset at the
phase's start through ``/proc/self/clear_refs`` where the kernel allows it.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.nn as nn

from ..core.state import units_in
from .baseline import usage_bytes, warm_baseline_bytes
from .process import peak_rss_bytes, reset_peak_rss


def fullshard_buffer_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes fullshard holds for ``model`` right now, by kind (read-only)."""
    return _buffer_bytes(units_in(model), list(model.parameters()))


def _buffer_bytes(units: list, params: list[torch.Tensor]) -> dict[str, int]:
    """What ``fullshard_buffer_bytes`` counts, from the units and parameters listed once
    (a tracker samples this before every unit's forward: no walk over the modules)."""
    counts = {"sharded parameters": 0, "unsharded parameters": 0, "gradients": 0,
              "pooled communication buffers": 0}
    roots, groups, buffers = set(), set(), set()
    for unit in units:
        # a unit's own group holds its shard; a batch (read each time: made at the first
        # forward) the gathered buffer it shares with its members as their ``unsharded``
        for group in (unit.group, unit.batch):
            if group is None or group in groups:
                continue
            groups.add(group)
            counts["sharded parameters"] += _nbytes(group.flat_shard)
            gathered = group.unsharded
            if gathered.built and not gathered.is_shard and id(gathered) not in buffers:
                buffers.add(id(gathered))
                counts["unsharded parameters"] += gathered.tensor.untyped_storage().nbytes()
            chunk = getattr(group.post_forward, "chunk", None)
            counts["unsharded parameters"] += _nbytes(chunk)
            if group.subclass is not None:  # their own bytes (NF4: half a byte a value)
                counts["sharded parameters"] += group.subclass.sharded_bytes()
                counts["unsharded parameters"] += group.subclass.unsharded_bytes()
        if unit.root is not None and id(unit.root) not in roots:
            roots.add(id(unit.root))
            counts["pooled communication buffers"] += unit.root.pool.idle_bytes()
    storages = {}
    for p in params:
        grad = p.grad
        if grad is not None:
            local = getattr(grad, "_local_tensor", grad)
            storages[local.untyped_storage().data_ptr()] = local.untyped_storage().nbytes()
    counts["gradients"] = sum(storages.values())
    return counts


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


class MemoryTracker:
    """Per-phase peak memory of this rank, and fullshard's buffers at their largest."""

    def __init__(self, device: torch.device | str | None = None, warm_up: bool = False):
        """Measure the process baseline now. ``warm_up`` first runs one sharded step of a
        tiny model (Note [a warm baseline]); it is collective: every rank must pass it."""
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) \
                if torch.cuda.is_available() else torch.device("cpu")
        self.device = torch.device(device)
        self.baseline_bytes = warm_baseline_bytes(self.device) if warm_up \
            else usage_bytes(self.device)
        self.model: nn.Module | None = None
        self.peak_resets_work = True
        self.step = 0
        self._phase: str | None = None
        self._phase_peaks: dict[str, int] = {}
        self._buffer_peaks: dict[str, dict[str, int]] = {}
        self._reserved_peak = 0  # CUDA: max_memory_reserved over the step's phases
        self._hooks: list = []
        self._units: list = []  # listed once by watch(): sampling walks no modules
        self._params: list[torch.Tensor] = []

    # -- what the trainer calls -------------------------------------------------------
    def watch(self, model: nn.Module) -> None:
        """Sample fullshard's buffers of ``model`` at phase edges and before each unit's
        forward (after fullshard has gathered it and issued the prefetch)."""
        self.model = model
        self._units = units_in(model)
        self._params = list(model.parameters())
        for unit in self._units:
            self._hooks.append(unit.module.register_forward_pre_hook(
                lambda _m, _a: self._sample_buffers()))

    def unwatch(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks, self.model, self._units, self._params = [], None, [], []

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Measure the block as phase ``name`` (forward, backward, optimizer, ...)."""
        self.start(name)
        try:
            yield
        finally:
            self.stop()

    def start(self, name: str) -> None:
        """End the current phase, if any, and start measuring ``name``."""
        self.stop()
        self._reset_peak()
        self._phase = name
        self._sample_buffers()

    def stop(self) -> None:
        """End the current phase (a phase repeated within a step keeps its largest peak)."""
        if self._phase is None:
            return
        self._sample_buffers()
        name, self._phase = self._phase, None
        self._phase_peaks[name] = max(self._phase_peaks.get(name, 0), self._peak())
        if self._is_cuda():
            self._reserved_peak = max(self._reserved_peak,
                                      torch.cuda.max_memory_reserved(self.device))

    def step_report(self) -> dict:
        """This step's figures, then start afresh for the next step::

            {"step": 3, "device": "cpu", "baseline_bytes": ..., "peak_bytes": ...,
             "peak_phase": "backward", "peak_resets_work": True,
             "phases": {"forward": {"peak_bytes": ..., "fullshard": {kind: bytes}}, ...}}

        ``peak_bytes`` includes the baseline (the process before the model existed):
        compare it with ``fullshard.memory.estimate(...).total``. On CUDA
        ``peak_reserved_bytes`` adds what the caching allocator held from the device at
        most: allocated plus its cached free blocks (fragmentation), the figure that
        decides an out-of-memory error.
        """
        self.stop()
        self.step += 1
        phases = {name: {"peak_bytes": peak, "fullshard": self._buffer_peaks.get(name, {})}
                  for name, peak in self._phase_peaks.items()}
        peak_phase = max(self._phase_peaks, key=self._phase_peaks.get, default=None)
        report = {"step": self.step, "device": self.device.type,
                  "baseline_bytes": self.baseline_bytes,
                  "peak_bytes": self._phase_peaks.get(peak_phase, self._peak()),
                  "peak_phase": peak_phase, "peak_resets_work": self.peak_resets_work,
                  "phases": phases}
        if self._is_cuda():  # what the caching allocator held from the device at most
            report["peak_reserved_bytes"] = self._reserved_peak
        self._phase_peaks, self._buffer_peaks = {}, {}
        self._reserved_peak = 0
        return report

    # -- measurement ------------------------------------------------------------------
    def _sample_buffers(self) -> None:
        if self.model is None or self._phase is None:
            return
        peaks = self._buffer_peaks.setdefault(self._phase, {})
        for kind, nbytes in _buffer_bytes(self._units, self._params).items():
            peaks[kind] = max(peaks.get(kind, 0), nbytes)

    def _is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def _reset_peak(self) -> None:
        if self._is_cuda():
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self.peak_resets_work = reset_peak_rss() and self.peak_resets_work

    def _peak(self) -> int:
        return torch.cuda.max_memory_allocated(self.device) if self._is_cuda() \
            else peak_rss_bytes()
