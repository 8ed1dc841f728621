"""DiskStates: an optimizer's states for the parameters of DiskOffloadPolicy units, on disk.

Note [optimizer states on disk]
``DiskOffloadPolicy`` is CPU offload (Note [CPU offload]) whose optimizer states live in
files instead of host memory: for fp32 Adam they are 8 of the 12 bytes per parameter
element the host keeps, so moving them to an NVMe disk is what lets a host hold a model
2-3x larger, as DeepSpeed's ZeRO-Infinity does for its optimizer states.

The step. The optimizer step hook (optim.py) hands the disk-offloaded parameters of an
elementwise optimizer to ``DiskStates.step`` before the ordinary step runs on the rest.
Their local shards are laid end to end and cut into chunks of ``chunk_numel`` elements;
a chunk may end inside a parameter, which is fine because the update is elementwise: a
slice of a parameter steps alone with the same slice of its gradient and states. For
each chunk the states are read into a staging set, the optimizer itself steps the
slices (``param_groups`` briefly hold only those slices, their states views of the
staging set; its step without the step hooks, which run once around ``step()``), and
the set is written back. Reads run one chunk ahead and writes behind,
on one I/O thread (offload/files.py), so three staging sets bound the host memory:
chunk c+1 being read, c stepping, c-1 being written. The read of the first chunk of
the next step is queued right after the last write, so it overlaps forward and backward.

Between steps ``optimizer.state[p]`` keeps its small entries (``step``) and, for each
per-element state, a placeholder: a DTensor on the meta device with the state's shape
and dtype. Arithmetic on it gives no numbers and ``.item()`` raises, so nothing reads a
stale value by mistake. Looking a state up by name (``optimizer.state[p]["exp_avg"]``)
reads its values from disk instead (``_EntryOnDisk``): code written for CPU offload, a
``.full_tensor()`` of it included, gets the same numbers, where a placeholder would join
the all-gather with no data. ``optimizer.state_dict()`` (and through it torch DCP's
``get_optimizer_state_dict`` and fullshard.checkpoint) returns the values read from
disk: a state-dict post-hook replaces the placeholders in the returned dict.

States that are real tensors at a step (the optimizer was just loaded from a state dict)
are the truth: they are copied into the staging sets, stepped and written, and replaced
by placeholders. That one rule covers loading before the first step and after later
ones. A step's pieces of one parameter each get a copy of the parameter's small states
as they were before the step (they advance together; the last piece's are kept).
"""

from __future__ import annotations

import weakref
from typing import Callable, NamedTuple

import torch
from torch.distributed.tensor import DTensor

from ..core.features.mapped import page_out
from ..policies import DiskOffloadPolicy
from .files import ALIGN, StateFiles


class Piece(NamedTuple):
    index: int    # which disk-offloaded parameter
    start: int    # element range of that parameter's local shard
    stop: int
    offset: int   # where the range starts inside its chunk


def _pieces(numels: list[int], chunk_numel: int) -> list[list[Piece]]:
    chunks: list[list[Piece]] = [[]]
    used = 0
    for i, n in enumerate(numels):
        start = 0
        while start < n:
            if used == chunk_numel:
                chunks.append([])
                used = 0
            take = min(n - start, chunk_numel - used)
            chunks[-1].append(Piece(i, start, start + take, used))
            start += take
            used += take
    return chunks


def _local(value: torch.Tensor) -> torch.Tensor:
    return value._local_tensor if isinstance(value, DTensor) else value


def _is_per_element(value, local: torch.Tensor) -> bool:
    """Whether a state value has one entry per element of ``local`` (a DTensor state: of
    its local tensor; a DTensor's own shape is the global one)."""
    if not isinstance(value, torch.Tensor):
        return False
    value = _local(value)
    return value.dim() > 0 and value.shape == local.shape


def _wrap_like(p: DTensor, local: torch.Tensor) -> DTensor:
    """``local`` as a DTensor placed as parameter ``p`` (a state of ``p``)."""
    if local.dtype == p.dtype:
        return DTensor(local, p._spec, requires_grad=False)
    return DTensor.from_local(local, p._spec.mesh, p._spec.placements, run_check=False,
                              shape=p.shape, stride=p.stride())


class _EntryOnDisk(dict):
    """An ``optimizer.state[p]`` entry whose per-element states are in the files. Its
    stored values stay the placeholders (what ``items()``, the step and the state-dict
    hook see); a lookup by name returns the value read from disk, a copy: writing to it
    changes nothing on disk. Weak: the entry must not keep the files open."""

    def __init__(self, values=(), states: "DiskStates | None" = None, index: int = -1):
        super().__init__(values)
        self._states = weakref.ref(states) if states is not None else None
        self._index = index

    def __getitem__(self, name):
        value = super().__getitem__(name)
        states = self._states() if self._states is not None else None
        if states is None or not (isinstance(value, torch.Tensor) and _local(value).is_meta):
            return value
        return states.values_of(self._index, (name,))[name]

    def get(self, name, default=None):
        return self[name] if name in self else default


class DiskStates:
    """One optimizer's disk-offloaded parameters under one ``DiskOffloadPolicy``."""

    def __init__(self, params: list[DTensor], policy: DiskOffloadPolicy, label: str):
        self.params = params
        self.key = tuple(id(p) for p in params)
        numels = [p._local_tensor.numel() for p in params]
        self.starts = [sum(numels[:i]) for i in range(len(numels))]
        # O_DIRECT-aligned for any dtype, and no larger than the states need
        chunk = -(-max(1, min(policy.chunk_numel, sum(numels))) // ALIGN) * ALIGN
        self.files = StateFiles(policy.path, sum(numels), chunk, label)
        self.chunks = _pieces(numels, chunk)
        self.on_disk: list[tuple[str, ...]] = [() for _ in params]  # state names in the files
        self.params_on_disk = [policy.params for _ in params]  # Note [parameters on disk]
        self._prefetched = None  # the read of chunk 0 queued after the last step's writes

    # -- the step ----------------------------------------------------------------------

    def step(self, opt: torch.optim.Optimizer, run_step: Callable[[], None]) -> None:
        """Step every disk-offloaded parameter of ``opt``, a chunk at a time (their
        gradients are ready; the caller then steps the other parameters)."""
        group_of = {id(p): g for g, group in enumerate(opt.param_groups) for p in group["params"]}
        states = [opt.state.get(p) or {} for p in self.params]
        real = [{k: _local(v) for k, v in s.items()
                 if _is_per_element(v, p._local_tensor) and not _local(v).is_meta}
                for p, s in zip(self.params, states)]
        small = [{k: v for k, v in s.items() if not _is_per_element(v, p._local_tensor)}
                 for p, s in zip(self.params, states)]
        stepped_small: dict[int, dict] = {}
        stepped_names: dict[int, tuple[str, ...]] = {}
        saved = [group["params"] for group in opt.param_groups]
        files = self.files
        try:
            if self._prefetched is None:
                self._read(0, real)
            self._prefetched = None
            for c, pieces in enumerate(self.chunks):
                staged = files.claim(c)  # read in, or its previous chunk written out
                if c + 1 < len(self.chunks):
                    self._read(c + 1, real)
                lists: list[list[torch.Tensor]] = [[] for _ in opt.param_groups]
                taken: list[tuple[Piece, torch.Tensor]] = []
                dirty = False
                for pc in pieces:
                    p = self.params[pc.index]
                    rows = slice(pc.offset, pc.offset + pc.stop - pc.start)
                    for name, full in real[pc.index].items():
                        files.ensure(name, full.dtype)  # adds to the staging set in place
                        staged[name][rows].copy_(full.reshape(-1)[pc.start:pc.stop])
                        dirty = True
                    names = tuple(real[pc.index]) or self.on_disk[pc.index]
                    dirty = dirty or bool(names)
                    if p.grad is None:
                        continue  # not stepped (torch skips it too); its states stay as read
                    piece = p._local_tensor.view(-1)[pc.start:pc.stop]
                    piece.grad = _local(p.grad).reshape(-1)[pc.start:pc.stop]
                    if names:
                        opt.state[piece] = {**{k: v.clone() for k, v in small[pc.index].items()},
                                            **{n: staged[n][rows] for n in names}}
                    lists[group_of[id(p)]].append(piece)
                    taken.append((pc, piece))
                if taken:
                    for group, chunk_params in zip(opt.param_groups, lists):
                        group["params"] = chunk_params
                    run_step()
                    for group, params in zip(opt.param_groups, saved):
                        group["params"] = params
                    for pc, piece in taken:
                        piece.grad = None
                        new = opt.state.pop(piece, {})
                        per_element = {k: v for k, v in new.items() if _is_per_element(v, piece)}
                        rows = slice(pc.offset, pc.offset + pc.stop - pc.start)
                        for name, value in per_element.items():
                            files.ensure(name, value.dtype)
                            target = staged[name][rows]
                            if value.data_ptr() != target.data_ptr():
                                target.copy_(value)  # created by this step (the first)
                        stepped_names[pc.index] = tuple(per_element)
                        stepped_small[pc.index] = {k: v for k, v in new.items()
                                                   if k not in per_element}
                        dirty = True
                if dirty:
                    files.submit(True, c)
                for pc, piece in taken:  # Note [parameters on disk]: stepped, give back
                    if self.params_on_disk[pc.index]:
                        page_out(piece)
        finally:
            for group, params in zip(opt.param_groups, saved):
                group["params"] = params
        for i, p in enumerate(self.params):
            names = stepped_names.get(i) or tuple(real[i]) or self.on_disk[i]
            if names:
                self._leave_on_disk(opt, i, names, stepped_small.get(i, small[i]))
        self._prefetched = self._read(0, None)  # overlaps the next forward and backward

    def _leave_on_disk(self, opt: torch.optim.Optimizer, i: int, names: tuple[str, ...],
                       kept: dict) -> None:
        """Parameter ``i``'s per-element states ``names`` are in the files now: its entry
        in ``opt.state`` holds meta tensors of their shapes and dtypes in their place,
        beside its small states ``kept`` (the step count)."""
        p = self.params[i]
        self.on_disk[i] = names
        opt.state[p] = _EntryOnDisk({**kept, **{n: _wrap_like(p, torch.empty(
            p._local_tensor.shape, dtype=self.files.dtypes[n], device="meta")) for n in names}},
            self, i)

    def _read(self, chunk: int, real: list[dict] | None):
        """Queue the read of ``chunk`` if any of its parameters has states only on disk."""
        if not self.files.dtypes or not any(
                self.on_disk[pc.index] and not (real and real[pc.index])
                for pc in self.chunks[chunk]):
            return None
        return self.files.submit(False, chunk)

    # -- state dicts -------------------------------------------------------------------

    def values_of(self, i: int, names: tuple[str, ...] | None = None) -> dict[str, torch.Tensor]:
        """Parameter ``i``'s per-element states ``names`` (all by default) read from disk,
        as DTensors."""
        p = self.params[i]
        local = p._local_tensor
        return {n: _wrap_like(p, self.files.read_range(n, self.starts[i], local.numel())
                              .view(local.shape))
                for n in (self.on_disk[i] if names is None else names)}

    def fill_state_dict(self, opt: torch.optim.Optimizer, state_dict: dict) -> None:
        """Replace the placeholders in ``opt.state_dict()``'s result by the values."""
        index = {}
        for group in opt.param_groups:
            for p in group["params"]:
                index.setdefault(id(p), len(index))
        for i, p in enumerate(self.params):
            key = index.get(id(p))
            entry = state_dict["state"].get(key)
            if not self.on_disk[i] or entry is None:
                continue
            if not any(isinstance(v, torch.Tensor) and _local(v).is_meta for v in entry.values()):
                continue  # real values (loaded after the last step): already the truth
            # a new dict: torch's state_dict shares the entry dicts with optimizer.state
            state_dict["state"][key] = {**entry, **self.values_of(i)}

    def materialize(self, opt: torch.optim.Optimizer) -> None:
        """Put the values back into ``opt.state`` (before this object is dropped)."""
        for i, p in enumerate(self.params):
            entry = opt.state.get(p)
            if self.on_disk[i] and entry and any(
                    isinstance(v, torch.Tensor) and _local(v).is_meta for v in entry.values()):
                opt.state[p] = {**entry, **self.values_of(i)}

    def close(self) -> None:
        self.files.close()
