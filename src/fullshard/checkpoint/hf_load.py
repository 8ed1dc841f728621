"""``load_hf``: a Hugging Face model's safetensors weights streamed into a sharded model,
each rank reading only the rows of the shards it owns.

Note [streaming safetensors into shards]
The trainer used to build the whole model on rank 0 (``from_pretrained``) and broadcast
it: rank 0 held the model in host memory and sent every byte. ``load_hf`` takes the
model already sharded, usually built with its parameters on the meta device
(``parameters_on_meta``), and every rank reads for itself: for each entry of the state
dict the rank takes the block its local shard covers (a DTensor's
``__create_chunk_list__``: rows ``[r*C, r*C + valid)`` for fullshard's ``Shard(0)``,
Note [padded dim-0 shards]; a column block for ``Shard(d)``; the whole for a replicated
tensor) and reads the file's bytes of its rows into its local tensor in place, casting
on the way (Note [reading rows into the shard]; Note [one storage is the shard]: nothing
is replaced). So an entry read as stored costs no host memory beyond the shard it fills
and a few MB of scratch: one copy, from the page cache. An entry transformers
converts from several tensors (Note [the model's own conversion]) is built whole, one at
a time, and the converter's tensors are what it holds beyond the shards (Mixtral's
experts stacked, then concatenated: up to twice the fused tensor). Everything is checked before anything is written: keys missing or in excess,
shapes, dtypes (floating-point tensors are cast to the model's dtype, others must
match), layouts, buffers left on the meta device, each a one-line CheckpointError
naming the key and file. The reads involve no collective; at the end the ranks agree, so
that a rank that failed (a file it cannot read) fails every rank in one line instead of
leaving the others to hang in training's first collective.
"""

from __future__ import annotations

import contextlib
import itertools
import os
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ..core.guard.arrival import every_rank_arrives
from ..core.mesh import mesh_device
from ..core.features.native_state_dict import native_state_dict
from .agreement import failed_ranks, on_every_rank
from .hf_keys import Converted, Direct, ignored_patterns, plan_keys
from .layout import CheckpointError
from .safetensors_files import SafetensorsFiles, Stored

_SHOWN = 3  # names listed in a message before "and N more"
_ANOTHER_MODEL = "it holds another model, or this one configured otherwise"


_WRAPPERS = ("_orig_mod", "_checkpoint_wrapped_module")  # torch.compile's, checkpointing's


@dataclass
class _Entry:
    """One state-dict entry of the model (tied names share one): where it is registered,
    the tensor, and the block of the whole that this rank holds (None: all of it)."""

    registered_as: str
    tensor: torch.Tensor
    index: tuple[slice, ...] | None

    @property
    def empty(self) -> bool:
        """This rank holds none of it (fewer rows than ranks)."""
        return self.index is not None and any(s.start == s.stop for s in self.index)

    @property
    def local(self) -> torch.Tensor:
        """The tensor this rank fills: its block of the whole."""
        return self.tensor.to_local() if isinstance(self.tensor, DTensor) else self.tensor


def load_hf(model: nn.Module, path: str | os.PathLike) -> None:
    """Load the weights of a Hugging Face model folder (``save_pretrained``'s safetensors
    files, with or without ``model.safetensors.index.json``), or of one ``.safetensors``
    file (``fullshard ckpt export``), into ``model``, sharded or not, in place.

    Each rank reads only the bytes of the shards it owns (Note [streaming safetensors into
    shards]); keys are renamed and converted as transformers does for the model's
    architecture (Note [the model's own conversion]). Parameters still on the meta device
    are materialized first (``to_empty`` on the mesh's device), keeping the buffers that
    were real: build the model under :func:`parameters_on_meta`. Collective when a
    process group is up: every rank calls it, and an error on any rank is raised on all.
    """
    path = os.fspath(path)
    distributed = dist.is_available() and dist.is_initialized()
    if distributed:
        every_rank_arrives("fullshard.checkpoint.load_hf")
    _, failed, error = on_every_rank(lambda: _load(model, path))
    if not failed:
        return
    world = dist.get_world_size() if distributed else 1
    if not distributed or (isinstance(error, CheckpointError) and len(failed) == world
                           and all(text == failed[0][1] for _, text in failed)):
        raise error  # every rank found the same: it is the whole story
    raise CheckpointError(f"load_hf: loading {path} failed on {len(failed)} of {world} ranks "
                          f"({failed_ranks(failed)}); every rank stops here (the model may hold part "
                          "of the weights). Fix what the failed ranks name and load again.")


def _load(model: nn.Module, path: str) -> None:
    files = SafetensorsFiles(path)
    try:
        entries, canonical = _entries(model)
        plan = plan_keys(model, set(canonical), list(files.tensors))
        direct = _chosen(plan.direct.values(), canonical)
        apart = _stored_apart(files, plan.direct.values(), canonical, direct)
        if apart:
            raise CheckpointError(
                f"load_hf: {path} holds {apart[0][0]} with values other than {apart[0][1]}, "
                "which this model ties it to; transformers' from_pretrained unties them and "
                "uses both: build the model with tie_word_embeddings=False in its config "
                "(fullshard train does) and load again")
        produced = _dry_run(model, plan.converted, files)
        _check(model, files, entries, direct, produced, plan.unexpected)
        files.prefetch([(key, entries[target].index) for target, key in direct.items()
                        if not entries[target].empty]
                       + [(key, None) for group in plan.converted for key, _ in group.sources])
        _materialize(model, entries)  # while the disk reads what was just asked for
        for target, key in direct.items():
            entry = entries[target]
            if not entry.empty:  # only this rank's block is read
                files.read(key, entry.index, into=entry.local)
        for group in plan.converted:  # one converted entry whole at a time
            for target, whole in group.run(model, files.read).items():
                _check_converted(files, group, canonical.get(target, target), whole, entries)
                entry = entries[canonical[target]]
                if not entry.empty:
                    with torch.no_grad():
                        entry.local.copy_(whole[entry.index] if entry.index is not None
                                          else whole)
    finally:
        files.close()


def _entries(model: nn.Module) -> tuple[dict[str, _Entry], dict[str, str]]:
    """The model's state-dict entries by canonical name (the first of tied names; without
    the names torch.compile's and checkpointing's wrappers add), and every state-dict
    name -> its canonical name."""
    with native_state_dict():
        names = list(model.state_dict(keep_vars=True))
    registered = dict(model.named_parameters(remove_duplicate=False))
    registered.update(model.named_buffers(remove_duplicate=False))
    entries: dict[str, _Entry] = {}
    first_of: dict[int, str] = {}
    canonical: dict[str, str] = {}
    for raw in names:
        tensor = registered.get(raw)
        if tensor is None:  # a state-dict hook's extra entry: nothing to load into
            continue
        name = ".".join(part for part in raw.split(".") if part not in _WRAPPERS)
        first = first_of.setdefault(id(tensor), name)
        canonical[name] = first
        if first == name:
            entries[name] = _Entry(raw, tensor, _local_index(name, tensor))
    return entries, canonical


def _local_index(name: str, tensor: torch.Tensor) -> tuple[slice, ...] | None:
    """The block of the whole tensor this rank's local tensor holds (None: the whole),
    or CheckpointError when it is not one block."""
    if not isinstance(tensor, DTensor):
        if type(tensor) not in (torch.Tensor, nn.Parameter):
            raise _unloadable(name, f"a {type(tensor).__name__} tensor subclass")
        return None
    chunks = tensor.__create_chunk_list__()
    local = tensor.to_local()
    if len(chunks) != 1 or tuple(chunks[0].sizes) != tuple(local.shape) \
            or type(local) is not torch.Tensor:
        raise _unloadable(name, f"a DTensor with placements {tuple(tensor.placements)} "
                          "whose local tensor is not one block of the whole")
    return tuple(slice(o, o + s) for o, s in zip(chunks[0].offsets, chunks[0].sizes))


def _unloadable(name: str, why: str) -> CheckpointError:
    return CheckpointError(f"load_hf: {name} is {why}, which cannot be loaded shard by "
                           "shard; load the weights before parallelizing or quantizing it")


def _chosen(direct: Iterable[Direct], canonical: dict[str, str]) -> dict[str, str]:
    """Canonical target -> the checkpoint key read into it (for tied names, the key of
    the canonical name itself when the checkpoint has several)."""
    chosen: dict[str, tuple[str, str]] = {}
    for d in direct:
        target = canonical[d.target]
        if target not in chosen or d.target == target:
            chosen[target] = (d.target, d.key)
    return {target: key for target, (_, key) in chosen.items()}


def tied_stored_apart(model: nn.Module, path: str | os.PathLike) -> list[tuple[str, str]]:
    """The names ``model`` ties to another (``lm_head.weight`` to the embedding) whose
    tensors the checkpoint at ``path`` stores with values of their own, as (name, the
    name it is tied to) pairs. transformers' ``from_pretrained`` unties those and keeps
    the stored values; a model built from the config must be built untied to match."""
    files = SafetensorsFiles(os.fspath(path))
    try:
        _, canonical = _entries(model)
        plan = plan_keys(model, set(canonical), list(files.tensors))
        return _stored_apart(files, plan.direct.values(), canonical,
                             _chosen(plan.direct.values(), canonical))
    finally:
        files.close()


def _stored_apart(files: SafetensorsFiles, direct: Iterable[Direct], canonical: dict[str, str],
                  chosen: dict[str, str]) -> list[tuple[str, str]]:
    """Tied names whose stored tensor differs from the one read into their parameter
    (compared whole, so every rank finds the same; only when both are stored)."""
    apart = []
    for d in direct:
        target = canonical[d.target]
        key = chosen[target]
        if d.key != key and not torch.equal(files.read(d.key), files.read(key)):
            apart.append((d.target, target))
    return apart


def _dry_run(model: nn.Module, groups: list[Converted], files: SafetensorsFiles
             ) -> dict[str, tuple[Converted, tuple[int, ...] | None]]:
    """Each converted target -> its group and shape, from the converters run on meta
    tensors (shape None where an operation cannot run on meta: checked when converted)."""
    produced = {}
    for group in groups:
        def meta(key: str) -> torch.Tensor:
            stored = files.tensors[key]
            return torch.empty(stored.shape, dtype=stored.torch_dtype or torch.uint8,
                               device="meta")
        try:
            out = group.run(model, meta)
        except Exception:  # noqa: BLE001 - an operation without meta support
            produced[group.layer] = (group, None)
            continue
        for target, value in out.items():
            produced[target] = (group, tuple(value.shape))
    return produced


def _check(model: nn.Module, files: SafetensorsFiles, entries: dict[str, _Entry],
           direct: dict[str, str], produced: dict, unexpected: list[str]) -> None:
    """Everything the load will do fits, or one CheckpointError; nothing is written."""
    may_lack = ignored_patterns(model, "missing")
    missing = [name for name, e in entries.items()
               if name not in direct and name not in produced
               and (e.tensor.is_meta or not any(p.search(name) for p in may_lack))]
    if missing:
        raise CheckpointError(f"load_hf: {files.path} has no tensor for the model's "
                              f"{_listed(missing)}; {_ANOTHER_MODEL}")
    may_have = ignored_patterns(model, "unexpected")
    excess = [k for k in unexpected if not any(p.search(k) for p in may_have)]
    if excess:
        raise _unexpected(files.tensors[excess[0]].file, _listed(excess))
    for target, key in direct.items():
        _check_fit(files.tensors[key], key, target, entries[target].tensor)
    for target, (group, shape) in produced.items():
        if shape is not None and target in entries:
            _check_shape(shape, _sources(files, group), target, entries[target].tensor)
    _check_buffers(files.path, model, entries, direct, produced)


def _check_fit(stored: Stored, key: str, target: str, tensor: torch.Tensor) -> None:
    _check_shape(stored.shape, f"{key} in {stored.file}", target, tensor)
    dtype = stored.torch_dtype
    if dtype != tensor.dtype and not (dtype is not None and dtype.is_floating_point
                                      and tensor.dtype.is_floating_point):
        raise CheckpointError(f"load_hf: {key} in {stored.file} is {stored.dtype}, which "
                              f"cannot be cast to the model's {target} "
                              f"({str(tensor.dtype).removeprefix('torch.')}); only "
                              "floating-point tensors are cast")


def _check_shape(shape, what: str, target: str, tensor: torch.Tensor) -> None:
    if tuple(shape) != tuple(tensor.shape):
        raise CheckpointError(f"load_hf: {what} has shape {tuple(shape)}, the model's "
                              f"{target} has {tuple(tensor.shape)}")


def _unexpected(file: str, keys: str) -> CheckpointError:
    return CheckpointError(f"load_hf: {file} holds {keys}, which the model has no "
                           f"parameter or buffer for; {_ANOTHER_MODEL}")


def _check_converted(files: SafetensorsFiles, group: Converted, target: str,
                     value: torch.Tensor, entries: dict[str, _Entry]) -> None:
    if target not in entries:  # a converter made a name the model lacks
        keys = [k for k, _ in group.sources]
        raise _unexpected(files.tensors[keys[0]].file, f"{_listed(keys)} (converted to "
                          f"{target})")
    _check_shape(value.shape, _sources(files, group), target, entries[target].tensor)


def _sources(files: SafetensorsFiles, group: Converted) -> str:
    keys = [k for k, _ in group.sources]
    where = sorted({files.tensors[k].file for k in keys})
    return f"{_listed(keys)} converted, in {', '.join(where)},"


def _check_buffers(path: str, model: nn.Module, entries: dict[str, _Entry],
                   direct: dict[str, str], produced: dict) -> None:
    """A buffer on the meta device that the checkpoint does not hold (one the state dict
    leaves out) would be left uninitialized by ``to_empty``."""
    loaded = set(direct) | set(produced)
    for name, buffer in model.named_buffers():
        if buffer.is_meta and name not in loaded:
            raise CheckpointError(
                f"load_hf: buffer {name} is on the meta device and {path} does not hold it "
                "(no checkpoint holds a buffer the state dict leaves out); build the model "
                "under fullshard.checkpoint.parameters_on_meta(), which leaves buffers real")


def _listed(names: list[str]) -> str:
    shown = ", ".join(names[:_SHOWN])
    return shown if len(names) <= _SHOWN else f"{shown} and {len(names) - _SHOWN} more"


def _materialize(model: nn.Module, entries: dict[str, _Entry]) -> None:
    """Parameters and buffers on the meta device made real (``to_empty`` on the mesh's
    device); what was real already is put back."""
    tensors = list(itertools.chain(model.parameters(), model.buffers()))
    if not any(t.is_meta for t in tensors):
        return
    kept = {name: (b if not isinstance(b, DTensor) else b.to_local()).detach().clone()
            for name, b in itertools.chain(model.named_parameters(), model.named_buffers())
            if not b.is_meta}
    model.to_empty(device=_device(tensors))
    with torch.no_grad():
        for name, b in itertools.chain(model.named_parameters(), model.named_buffers()):
            if name in kept:
                (b.to_local() if isinstance(b, DTensor) else b).copy_(kept[name])
    for entry in entries.values():  # to_empty may have registered new objects
        entry.tensor = _registered(model, entry.registered_as)


def _registered(model: nn.Module, name: str) -> torch.Tensor:
    owner, _, attr = name.rpartition(".")
    module = model.get_submodule(owner)
    return module._parameters[attr] if attr in module._parameters else module._buffers[attr]


def _device(tensors: list[torch.Tensor]) -> torch.device:
    """The device meta tensors are made real on: a sharded parameter's mesh device, else
    that of any real tensor, else the CPU."""
    for t in tensors:
        if isinstance(t, DTensor):
            return mesh_device(t.device_mesh)
    return next((t.device for t in tensors if not t.is_meta), torch.device("cpu"))


# transformers' mark on a weight its initialization must leave as it is
_INITIALIZED = "_is_hf_initialized"


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Build modules with their parameters on the meta device and their buffers real:
    ``with parameters_on_meta(): model = AutoModelForCausalLM.from_config(config)``.

    Buffers a state dict leaves out (rotary embeddings' ``inv_freq``) are in no
    checkpoint: built real, they survive ``load_hf``'s ``to_empty``. Each parameter is
    moved to the meta device as it is registered (``nn.Module.register_parameter``, for
    the duration of the block, in this process: build nothing else meanwhile).

    A meta tensor has no values to initialize, so the block also marks each parameter as
    transformers marks weights already loaded (``_is_hf_initialized``), and its model's
    weight initialization passes them by: torch's random fills on meta tensors run
    through Python decompositions (0.2 s of a 155M-parameter Llama's 0.28 s
    ``from_config``). The marks go when the block ends, so a model initialized later
    (after ``to_empty``) is initialized whole."""
    register = nn.Module.register_parameter
    marked: list[nn.Parameter] = []

    def register_on_meta(module: nn.Module, name: str, param) -> None:
        register(module, name, param)
        param = module._parameters.get(name)
        if param is None:
            return
        if not param.is_meta:
            param = module._parameters[name] = type(param)(param.to("meta"),
                                                           requires_grad=param.requires_grad)
        if not hasattr(param, _INITIALIZED):
            setattr(param, _INITIALIZED, True)
            marked.append(param)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register
        for param in marked:
            with contextlib.suppress(AttributeError):
                delattr(param, _INITIALIZED)
