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

Note [the disk step on the host thread]
The files are laid out unit by unit, in the order forward gathers the units (each
parameter's unit is its group's place in that order among the store's own units,
core/state.groups_in_order: another model sharded or dropped beside this one moves
nothing, where a change would read every state back into memory to lay the files out
again), and
every unit starts a chunk of its own on an ALIGN boundary: a chunk never holds two units'
states, so one unit's chunks step without touching another's. That is what lets
``OverlappedStep`` (overlapped_step.py) treat a disk-offloaded unit as it treats a
CPU-offloaded one: ``step()`` takes every parameter whose states are on disk out of the
device step and hands each unit to the host thread, in forward order; the host thread
steps the unit's chunks (``step_chunks``) with a copy of the optimizer whose groups hold
the hyperparameters as ``step()`` saw them, and the next forward's gather of the unit
waits for that unit alone. Units stepped in forward order read the files in order, so
the read-ahead of the next chunk (the next unit's first, past a unit's last) and the
read of chunk 0 after the last write carry over from one unit to the next as they do
within one step; a unit skipped (no gradient) makes the next one queue its own read.
The padding costs less than ALIGN elements per unit. While a unit's step runs, the host
thread owns the files: every read from outside the pipeline (``values_of``, which state
dicts, a lookup by name and ``materialize`` go through) first waits for the host steps.
An entry whose values are real when its unit is handed over (loaded from a state dict)
becomes an ``_EntryInFlight`` until the host thread puts the placeholders in its place:
a lookup by name waits too, and answers from what the step left.
The results are those of ``optimizer.step()`` bit for bit: an elementwise update of the
same pieces with the same gradients, states and hyperparameters. Inside
``stepping_in_backward()`` a disk unit is handed out as its gradients are, in backward's
order: its step reads ahead, after its own chunks, the first chunk of the unit before it
in the files (from the first unit, of the last), the one backward reduces next; that read
is queued after the unit's last write, since its staging set may be the last chunk's.
The delayed update refuses disk units (E345).
"""

from __future__ import annotations

import weakref
from typing import Callable, NamedTuple

import torch
from torch.distributed.tensor import DTensor

from ..core.features.mapped import page_out
from ..core.state import finish_host_steps
from ..policies import DiskOffloadPolicy
from .files import ALIGN, StateFiles


class Piece(NamedTuple):
    index: int    # which disk-offloaded parameter
    start: int    # element range of that parameter's local shard
    stop: int
    offset: int   # where the range starts inside its chunk


class Chunk(NamedTuple):
    start: int            # its first element in the files
    pieces: list[Piece]   # what it holds, in order from element 0 of the chunk

    @property
    def numel(self) -> int:
        return self.pieces[-1].offset + self.pieces[-1].stop - self.pieces[-1].start


def _chunks(numels: list[int], units: list[int], chunk_numel: int) -> list[Chunk]:
    """The parameters' local shards laid end to end, cut into chunks of at most
    ``chunk_numel`` elements (a multiple of ALIGN). Each unit (``units[i]``: parameter
    ``i``'s, equal for neighbours of one unit) starts a chunk of its own on an ALIGN
    boundary of the files, so that a unit's states step without its neighbours' (Note
    [the disk step on the host thread])."""
    chunks: list[Chunk] = []
    used = chunk_numel  # the last chunk is full: the next piece starts a new one
    unit = None
    for i, n in enumerate(numels):
        if units[i] != unit:
            unit, used = units[i], chunk_numel
        start = 0
        while start < n:
            if used == chunk_numel:
                at = 0 if not chunks else -(-(chunks[-1].start + chunks[-1].numel) // ALIGN) * ALIGN
                chunks.append(Chunk(at, []))
                used = 0
            take = min(n - start, chunk_numel - used)
            chunks[-1].pieces.append(Piece(i, start, start + take, used))
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


class _Entry(dict):
    """An ``optimizer.state[p]`` entry whose lookups by name answer more than the stored
    value; ``get`` goes through them too."""

    def get(self, name, default=None):
        return self[name] if name in self else default


class _EntryOnDisk(_Entry):
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


class _EntryInFlight(_Entry):
    """An ``optimizer.state[p]`` entry whose values (real ones: loaded, or read back when
    the store was made again) a host-thread step is moving into the files (Note [the disk
    step on the host thread]). A lookup by name first waits for the host steps, then
    answers from the entry the step left in its place. Weak, as ``_EntryOnDisk``."""

    def __init__(self, values, opt: torch.optim.Optimizer, param: DTensor):
        super().__init__(values)
        self._opt, self._param = weakref.ref(opt), weakref.ref(param)

    def __getitem__(self, name):
        finish_host_steps()
        opt, param = self._opt(), self._param()
        current = opt.state.get(param) if opt is not None and param is not None else None
        if current is not None and current is not self:
            return current[name]
        return super().__getitem__(name)


class DiskStates:
    """One optimizer's disk-offloaded parameters under one ``DiskOffloadPolicy``."""

    def __init__(self, params: list[DTensor], units: list[int], policy: DiskOffloadPolicy,
                 label: str):
        """``params`` grouped by unit (``units[i]``: the order forward gathers parameter
        ``i``'s unit in), in the order their states are laid out in the files."""
        self.params = params
        self.units = units
        self.key = tuple(zip(map(id, params), units))
        numels = [p._local_tensor.numel() for p in params]
        # O_DIRECT-aligned for any dtype, and no larger than the states need
        chunk = -(-max(1, min(policy.chunk_numel, sum(numels))) // ALIGN) * ALIGN
        self.chunks = _chunks(numels, units, chunk)
        self.starts = [0] * len(params)  # each parameter's first element in the files
        for c in reversed(self.chunks):
            for pc in c.pieces:
                if pc.start == 0:
                    self.starts[pc.index] = c.start + pc.offset
        # each chunk's unit, and each unit's chunks (what a host-thread step of it steps)
        self.chunk_units = [units[c.pieces[0].index] for c in self.chunks]
        self.unit_chunks: dict[int, range] = {}
        for c, u in enumerate(self.chunk_units):
            self.unit_chunks[u] = range(self.unit_chunks.get(u, range(c, c)).start, c + 1)
        self.files = StateFiles(policy.path, [(c.start, c.numel) for c in self.chunks],
                                chunk, label)
        self.on_disk: list[tuple[str, ...]] = [() for _ in params]  # state names in the files
        self.params_on_disk = [policy.params for _ in params]  # Note [parameters on disk]
        # the chunk whose read (if it needs one) is queued already: the next one after a
        # chunk steps, chunk 0 after the last step's writes (it overlaps the next forward)
        self._queued: int | None = None

    def chunks_of(self, indices: list[int]) -> range:
        """The chunks of the units of parameters ``indices`` (one unit's, as a host-thread
        step hands them over)."""
        ranges = [self.unit_chunks[self.units[i]] for i in indices]
        return range(min(r.start for r in ranges), max(r.stop for r in ranges))

    # -- the step ----------------------------------------------------------------------

    def step(self, opt: torch.optim.Optimizer, run_step: Callable[[], None]) -> None:
        """Step every disk-offloaded parameter of ``opt``, a chunk at a time (their
        gradients are ready; the caller then steps the other parameters)."""
        grads = {i: _local(p.grad) for i, p in enumerate(self.params) if p.grad is not None}
        self.step_chunks(opt, opt, run_step, range(len(self.chunks)), grads)

    def hand_over(self, opt: torch.optim.Optimizer, indices) -> None:
        """Before the host thread steps parameters ``indices``: an entry of theirs that is
        not on disk yet becomes one whose lookups wait for that step, so that code reading
        a state by name right after ``step()`` reads the stepped value, as it does from an
        entry on disk."""
        for i in indices:
            p = self.params[i]
            entry = opt.state.get(p)
            if entry and not isinstance(entry, (_EntryOnDisk, _EntryInFlight)):
                opt.state[p] = _EntryInFlight(entry, opt, p)

    def previous_unit(self, chunks: range) -> int:
        """The first chunk of the unit before the one ``chunks`` holds in the files (from
        the first unit: of the last), the unit backward reduces next."""
        return self.unit_chunks[self.chunk_units[chunks.start - 1]].start  # -1: the last

    def step_chunks(self, opt: torch.optim.Optimizer, stepper: torch.optim.Optimizer,
                    run_step: Callable[[], None], chunks: range,
                    grads: dict[int, torch.Tensor], then: int | None = None,
                    groups: dict[int, int] | None = None) -> None:
        """Step the parameters in ``chunks`` (a unit's, or all) with their local gradients
        ``grads`` (by parameter index; one without steps nothing, as torch skips it).
        ``run_step`` runs ``stepper``'s step over what its ``param_groups`` hold; ``stepper``
        is ``opt`` itself, or on the host thread a copy with its own groups and state
        (overlapped_step.py). ``opt.state`` holds the entries. ``then``: the chunk to read
        ahead after these (by default the next, past the last chunk the first).
        ``groups``: each stepped parameter's index among ``opt.param_groups``, found by the
        caller; read from ``opt.param_groups`` when not given, which only the thread that
        owns them may do (on the host thread ``OverlappedStep.step`` may be changing them:
        it steps the device's parameters alone meanwhile)."""
        indices = sorted({pc.index for c in chunks for pc in self.chunks[c].pieces})
        if groups is None:
            group_of = {id(p): g for g, group in enumerate(opt.param_groups)
                        for p in group["params"]}
            groups = {i: group_of[id(self.params[i])] for i in grads}
        states = {i: opt.state.get(self.params[i]) or {} for i in indices}
        real = {i: {k: _local(v) for k, v in states[i].items()
                    if _is_per_element(v, self.params[i]._local_tensor) and not _local(v).is_meta}
                for i in indices}
        small = {i: {k: v for k, v in states[i].items()
                     if not _is_per_element(v, self.params[i]._local_tensor)} for i in indices}
        stepped_small: dict[int, dict] = {}
        stepped_names: dict[int, tuple[str, ...]] = {}
        saved = [group["params"] for group in stepper.param_groups]
        files, last = self.files, len(self.chunks) - 1
        if then is None:
            then = chunks.stop if chunks.stop <= last else 0
        try:
            if self._queued != chunks.start:
                self._read(chunks.start, real)
            self._queued = None
            for c in chunks:
                staged = files.claim(c)  # read in, or its previous chunk written out
                if c + 1 < chunks.stop or then == c + 1:  # a set other than c's: read now
                    self._queued = c + 1 if self._read(c + 1, real) else None
                lists: list[list[torch.Tensor]] = [[] for _ in stepper.param_groups]
                taken: list[tuple[Piece, torch.Tensor]] = []
                dirty = False
                for pc in self.chunks[c].pieces:
                    p = self.params[pc.index]
                    rows = slice(pc.offset, pc.offset + pc.stop - pc.start)
                    for name, full in real[pc.index].items():
                        files.ensure(name, full.dtype)  # adds to the staging set in place
                        staged[name][rows].copy_(full.reshape(-1)[pc.start:pc.stop])
                        dirty = True
                    names = tuple(real[pc.index]) or self.on_disk[pc.index]
                    dirty = dirty or bool(names)
                    grad = grads.get(pc.index)
                    if grad is None:
                        continue  # not stepped (torch skips it too); its states stay as read
                    piece = p._local_tensor.view(-1)[pc.start:pc.stop]
                    piece.grad = grad.reshape(-1)[pc.start:pc.stop]
                    if names:
                        stepper.state[piece] = {
                            **{k: v.clone() for k, v in small[pc.index].items()},
                            **{n: staged[n][rows] for n in names}}
                    lists[groups[pc.index]].append(piece)
                    taken.append((pc, piece))
                if taken:
                    for group, chunk_params in zip(stepper.param_groups, lists):
                        group["params"] = chunk_params
                    run_step()
                    for group, params in zip(stepper.param_groups, saved):
                        group["params"] = params
                    for pc, piece in taken:
                        piece.grad = None
                        new = stepper.state.pop(piece, {})
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
            for group, params in zip(stepper.param_groups, saved):
                group["params"] = params
        for i in indices:
            names = stepped_names.get(i) or tuple(real[i]) or self.on_disk[i]
            if names:
                self._leave_on_disk(opt, i, names, stepped_small.get(i, small[i]))
        if then != chunks.stop:  # after the last write, whose staging set it may share
            self._queued = then if self._read(then, None) else None

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

    def _read(self, chunk: int, real: dict[int, dict] | None):
        """Queue the read of ``chunk`` if any of its parameters has states only on disk."""
        if not self.files.dtypes or not any(
                self.on_disk[pc.index] and not (real and real.get(pc.index))
                for pc in self.chunks[chunk].pieces):
            return None
        return self.files.submit(False, chunk)

    # -- state dicts -------------------------------------------------------------------

    def values_of(self, i: int, names: tuple[str, ...] | None = None) -> dict[str, torch.Tensor]:
        """Parameter ``i``'s per-element states ``names`` (all by default) read from disk,
        as DTensors."""
        finish_host_steps()  # Note [the disk step on the host thread]: the files at rest
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
