"""ShardedParam: one parameter's life between its shard and its unsharded form, and the
registry of the sharded parameters fullshard made (at the end of this file).

Note [padded dim-0 shards]
Each parameter of shape (R, *rest) is split on dim 0 into chunks of
``C = ceil(R / world)`` rows; rank r owns rows [r*C, (r+1)*C) clipped to R, which is
exactly DTensor's ``Shard(0)`` layout (trailing ranks may own fewer rows or none).
Every rank stores a full C-row *padded* shard so all ranks contribute equal-sized
pieces to the unit's all-gather; the DTensor's local tensor is the first ``valid``
rows of that padded shard. The padded shard is a view into the unit's flat sharded
buffer (see ParamGroup), so the all-gather reads the shards with no copy-in.

Note [shards on another dim]
``shard_placement_fn`` may return ``Shard(d)`` for d > 0 (e.g. expert weights with
fewer experts than ranks). As in torch, the dim must divide evenly, so there is no
padding: rank r's shard is the r-th chunk of dim d, stored contiguously in the flat
shard. Gathered rank-major, the chunks are in the wrong order for the unsharded
parameter (its elements interleave the ranks' chunks once per index of the dims
before d), so each such parameter is copied out through a strided view
(``copy_gathered``) instead of joining the one ``split_with_sizes_copy``; gradients
enter the reduce-scatter through the opposite view (``rank_major``), which
``torch._chunk_cat`` reads without an extra copy.

Note [unsharded params are persistent views]
The unsharded parameter is created once and keeps its identity across steps: it is
a view into the unit's flat unsharded buffer whose storage is resized to zero when
the unit reshards and back when it unshards. Autograd's AccumulateGrad node is tied
to the tensor object, so a persistent object means one gradient hook registration
and one accumulation per backward even when a module runs twice in a forward.
The writer of all-gathered data uses an alias of the buffer with its own version
counter (``.data``), so refilling the storage does not invalidate tensors that
autograd saved in forward.

Note [one storage is the shard]
The invariant: for every parameter, three names denote one memory.
  (1) ``sharded_param`` is the DTensor registered in the module (``module._parameters``)
      and the one object optimizers and state dicts hold;
  (2) its ``_local_tensor`` is the first ``valid_rows`` rows of ``padded_shard``;
  (3) ``padded_shard`` is a view of the flat shard of the unit's group, the buffer
      that group all-gathers (or, in a batch of small units, copies into the batch's
      all-gather: Note [a batch reads its members' shards]).
So an in-place update of (1), by the optimizer or a load, is what the next all-gather
sends. Who may replace what:
* Values change in place only: ``optimizer.step()`` (also the local step, which
  swaps in (2) itself for the step and back, Note [optimizer steps on local shards]),
  ``load_state_dict`` without ``assign``, ``set_model_state_dict``, DCP's load into a
  state dict, ``set_optimizer_state_dict`` (optimizer states only), summon_full_params'
  write-back. None of them replaces (1), (2) or (3).
* (1) is replaced by ``load_state_dict(assign=True)`` and by a module reassigning the
  attribute: the post-load hook, or lazy init for assignments before the first
  forward, calls ``ParamGroup.readopt``, which copies the new local values into (3)
  and points the new DTensor's local tensor at it. An optimizer still holding the old
  object raises at its next step (optim.py, _owner_for_step); it must be rebuilt, exactly
  as for a plain module.
* ``_apply`` (``.to()``, ``.cuda()``, ``.float()``, ``to_empty``) swaps a new tensor
  into the same DTensor object; ``FSDPModule._apply`` then calls ``readopt``, which
  reallocates (3) when the device or dtype changed and re-points (2).
* (3) is replaced only by its group's ``readopt`` (device/dtype change). A unit's group
  is its own for life: gathering small units together at lazy init (core/buckets.py)
  makes a batch that reads its members' flat shards and re-points nothing, so an
  optimizer built before the first forward keeps stepping the memory every gather
  reads.
* CPU offload keeps (3) on the CPU; the gather sends a device copy of it, made from (3)
  at every unshard. NO_SHARD aliases the unsharded parameters to (3) itself (Note
  [shard groups of one rank]); hpZ keeps a chunk of the *unsharded* buffer, never (3).
The guard: at every ``optimizer.step()`` each fullshard parameter the optimizer holds
is checked to be (1) and to satisfy (2) (one pointer comparison each); a violation
raises naming the parameter instead of training on silently.
"""

from __future__ import annotations

import dataclasses
import math
import weakref
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from .features.grad_dtype import UNSET, GradDtype
from .features.grad_dtype import give as give_grad_dtype
from .features.grad_dtype import read as read_grad_dtype
from .features.subclass_params import KeptDtypeShard, SubclassShard, has_all_gather_hooks
from .features.spmd_mesh import SpmdDims, spmd_layout
from .features.tensor_parallel import local_grad, sharded_layout
from .refusals.torch_errors import torch_first


@dataclass(frozen=True)
class ParamRef:
    """Where a parameter is registered: ``module._parameters[name]`` (fqn for messages)."""

    module: nn.Module
    name: str
    fqn: str


@dataclass(frozen=True)
class ShardLayout:
    """Sizes of one parameter's shard on one rank: padded rows on dim 0 (Note [padded
    dim-0 shards]), or an even split of another dim (Note [shards on another dim])."""

    shape: torch.Size
    rows_per_rank: int   # along ``dim``
    valid_rows: int
    row_numel: int       # elements per index of ``dim``
    dim: int = 0

    @staticmethod
    def of(shape: torch.Size, rank: int, world_size: int, dim: int = 0) -> "ShardLayout":
        rows = shape[dim]
        rows_per_rank = math.ceil(rows / world_size)
        valid = max(0, min(rows_per_rank, rows - rank * rows_per_rank))
        return ShardLayout(shape, rows_per_rank, valid,
                           math.prod(n for i, n in enumerate(shape) if i != dim), dim)

    @property
    def shard_numel(self) -> int:
        return self.rows_per_rank * self.row_numel

    def padded_shape(self, rows: int) -> tuple[int, ...]:
        return (*self.shape[:self.dim], rows, *self.shape[self.dim + 1:])

    def valid(self, padded: torch.Tensor) -> torch.Tensor:
        """This rank's real rows of a padded shard (a view)."""
        return padded.narrow(self.dim, 0, self.valid_rows)

    def padding(self, padded: torch.Tensor) -> torch.Tensor:
        """The rows of a padded shard past this rank's real ones (a view, often empty)."""
        return padded.narrow(self.dim, self.valid_rows, self.rows_per_rank - self.valid_rows)

    def copy_gathered(self, world_size: int, rank_major: torch.Tensor,
                      unsharded: torch.Tensor) -> None:
        """Copy ``rank_major`` (world x shard_numel, rank r's shard in row r) into this
        parameter's ``unsharded`` region (world * shard_numel elements, its own element
        order); another dim goes through a strided view (Note [shards on another dim])."""
        if self.dim == 0:
            unsharded.copy_(rank_major)
        else:
            # view, never reshape: the copy must land in ``unsharded`` itself
            unsharded.view(self._outer(), world_size, -1).transpose(0, 1).copy_(
                rank_major.view(world_size, self._outer(), -1))

    def rank_major(self, world_size: int, unsharded: torch.Tensor) -> torch.Tensor:
        """An unsharded tensor as a (world, ...) view whose row r is rank r's shard, for
        ``torch._chunk_cat``; dim 0 needs no view."""
        if self.dim == 0:
            return unsharded
        return unsharded.reshape(self._outer(), world_size, -1).transpose(0, 1)

    def _outer(self) -> int:
        """Elements before ``dim``: how many times the ranks' chunks interleave."""
        return math.prod(self.shape[:self.dim])


class ShardedParam:
    """One parameter of a unit: its DTensor shard, its unsharded view, where it is registered."""

    def __init__(self, refs: list[ParamRef], param: nn.Parameter, mesh: DeviceMesh,
                 rank: int, world_size: int, unit_label: str = "",
                 spmd: SpmdDims | None = None, dim: int = 0, keep_dtype: bool = False):
        # rank / world_size are this rank's place in the *shard* dimension; on a 2-D
        # (replicate, shard) mesh the parameter is replicated across the other one.
        self.refs = refs
        self.fqn = refs[0].fqn
        # A DTensor on a tensor-parallel mesh: its local piece is what is sharded here
        # (Note [sharding a tensor-parallel parameter]).
        self.tp_spec: DTensorSpec | None = param._spec if isinstance(param, DTensor) else None
        local = self.local_value(param)
        if local.dim() == 0:
            raise ValueError(torch_first(
                "fully_shard doesn't support scalar parameters. Change "
                f"{self.fqn} to a 1D tensor with numel equal to 1.",
                f"fully_shard({unit_label}): parameter '{self.fqn}' is 0-dimensional; "
                "fullshard shards on dim 0. Reshape it to shape (1,) or pass it in "
                "ignored_params."))
        self.rank = rank
        self.world_size = world_size
        if dim and local.shape[dim] % world_size:
            raise NotImplementedError(torch_first(
                f"FSDP does not support uneven sharding on dim {dim}: {local.shape} "
                f"(world size: {world_size})",
                f"fully_shard({unit_label}): shard_placement_fn returned Shard({dim}) for "
                f"parameter '{self.fqn}' of shape {tuple(local.shape)}, whose dim {dim} "
                f"({local.shape[dim]}) does not divide evenly over {world_size} ranks; "
                "dims other than 0 are sharded evenly only (as in torch). Return Shard(0) "
                "or None for it."))
        self.layout = ShardLayout.of(local.shape, rank, world_size, dim)
        self.global_shape = param.shape
        self.dp_indices: frozenset[int] = frozenset()
        if self.tp_spec is None:
            spec_mesh = mesh
            self.placements = (Shard(dim),) if mesh.ndim == 1 else (Replicate(), Shard(dim))
        else:
            where = (f"fully_shard({unit_label}): parameter '{self.fqn}' is a DTensor on "
                     f"mesh {self.tp_spec.mesh}")
            tp = (spmd_layout(spmd, self.tp_spec, where, dim) if spmd is not None
                  else sharded_layout(mesh, self.tp_spec, where, dim))
            spec_mesh, self.placements, self.dp_indices = tp.mesh, tp.placements, tp.dp_indices
        self.spec = DTensorSpec(
            spec_mesh, self.placements,
            tensor_meta=TensorMeta(param.shape, param.stride(), param.dtype))
        self.sharded_param: nn.Parameter | None = None
        self.padded_shard: torch.Tensor | None = None
        self.unsharded_param: nn.Parameter | None = None
        self.offload = None  # its unit's CPUOffloadPolicy / DiskOffloadPolicy, set by the group
        self.accumulated_grad: torch.Tensor | None = None  # no-sync sum in reduce_dtype
        # its .grad came only from reductions whose presence flags are not read yet (Note
        # [gradient presence flags]): zeros that may go back to None
        self.presence_unknown = False
        # Note [a parameter's grad_dtype]: its policy, carried by the sharded parameter,
        # and what the unsharded parameter's grad_dtype is set to (from lazy init)
        self.grad_policy: GradDtype = read_grad_dtype(param)
        self.unsharded_grad_policy: GradDtype = UNSET
        # sharded-gradient specs in dtypes other than the parameter's (by dtype)
        self._grad_specs: dict[torch.dtype, DTensorSpec] = {}
        # Note [tensor-subclass parameters]: gathered through the subclass's own hooks, or
        # in its own dtype beside a unit computing in another (param_dtype_override_fn)
        self.extension: SubclassShard | None = (
            SubclassShard(self.fqn, refs[0].module, param)
            if self.tp_spec is None and has_all_gather_hooks(param) else
            KeptDtypeShard(self.fqn, refs[0].module, param) if keep_dtype else None)

    def local_value(self, tensor: torch.Tensor) -> torch.Tensor:
        """The plain tensor fullshard shards: a TP DTensor's local piece, else itself."""
        return tensor._local_tensor if self.tp_spec is not None else tensor

    def local_grad(self, grad: torch.Tensor | None) -> torch.Tensor | None:
        """An unsharded gradient as the plain tensor that is reduced."""
        if grad is None or self.tp_spec is None:
            return grad
        return local_grad(grad, self.tp_spec, self.dp_indices)

    @property
    def unsharded_local(self) -> torch.Tensor:
        """The unsharded parameter's values as a plain tensor (a view of the gathered buffer)."""
        return self.local_value(self.unsharded_param)

    # -- sharded side -------------------------------------------------------------------
    def shard_from(self, full: torch.Tensor, flat_view: torch.Tensor, requires_grad: bool) -> None:
        """Copy this rank's rows of ``full`` into ``flat_view`` and register the DTensor."""
        lay = self.layout
        self.padded_shard = flat_view.view(lay.padded_shape(lay.rows_per_rank))
        start = min(self.rank * lay.rows_per_rank, lay.shape[lay.dim])  # trailing ranks: none
        local = lay.valid(self.padded_shard)
        with torch.no_grad():
            lay.padding(self.padded_shard).zero_()
            local.copy_(full.detach().narrow(lay.dim, start, lay.valid_rows))
        self.sharded_param = nn.Parameter(DTensor(local, self.spec, requires_grad=False),
                                          requires_grad=requires_grad)
        # Gradients reuse the parameter's own spec object: DTensor's sharding cache then
        # matches them by identity instead of comparing specs field by field.
        self.spec = self.sharded_param._spec
        give_grad_dtype(self.sharded_param, self.grad_policy)
        track(self)
        self.register(self.sharded_param)

    def shard_subclass(self, full: torch.Tensor, label: str, requires_grad: bool,
                       device: torch.device) -> None:
        """Register the DTensor whose local tensor is this rank's shard of the subclass
        parameter ``full``, made by the subclass, on ``device`` (the host under CPU
        offload; Note [tensor-subclass parameters])."""
        local = self.extension.shard(label, full, self.rank, self.world_size)
        if local.device != device and not local.is_meta:
            local = local.to(device)
        self._adopt(nn.Parameter(DTensor(local, self.spec, requires_grad=False),
                                 requires_grad=requires_grad))

    def readopt(self, flat_view: torch.Tensor | None, copy_values: bool = True) -> None:
        """Re-attach to whatever DTensor is registered now (after ``_apply`` or
        ``load_state_dict(assign=True)``) and make its local tensor view ``flat_view``
        (holding its values, unless ``copy_values`` is False)."""
        ref = self.refs[0]
        current = ref.module._parameters.get(ref.name)
        if current is None:
            raise RuntimeError(f"fullshard: parameter '{self.fqn}' was removed from its module "
                               "after fully_shard; re-register it or shard the module again.")
        if not isinstance(current, DTensor):
            raise TypeError(
                f"fullshard: parameter '{self.fqn}' was replaced by a plain tensor after "
                "fully_shard. Load sharded values instead: build them with "
                "torch.distributed.tensor.distribute_tensor(full, param.device_mesh, "
                "param.placements) and load those.")
        if current.shape != self.global_shape or current.placements != self.placements:
            raise ValueError(
                f"fullshard: parameter '{self.fqn}' was replaced by a DTensor of shape "
                f"{tuple(current.shape)} and placements {current.placements}; expected shape "
                f"{tuple(self.global_shape)} with {self.placements}.")
        if self.extension is not None:  # its local tensor is what its next gather reads
            self._adopt(current)
            return
        lay = self.layout
        old_local = current._local_tensor
        self.padded_shard = flat_view.view(lay.padded_shape(lay.rows_per_rank))
        new_local = lay.valid(self.padded_shard)
        if not _same_memory(old_local, new_local):
            with torch.no_grad():
                if copy_values and not old_local.is_meta and not new_local.is_meta:
                    new_local.copy_(old_local)
                lay.padding(self.padded_shard).zero_()
            current._local_tensor = new_local
        self._adopt(current)

    def _adopt(self, current: DTensor) -> None:
        # a replacement loses grad_dtype: it is given the policy the old one carried (Note
        # [a parameter's grad_dtype])
        for param in (self.sharded_param, current):
            found = read_grad_dtype(param) if param is not None else UNSET
            if found.explicit:
                self.grad_policy = found
        give_grad_dtype(current, self.grad_policy)
        self.sharded_param = current
        self.spec = current._spec
        self._grad_specs.clear()
        track(self)
        self.register(current)

    # -- unsharded side -----------------------------------------------------------------
    def make_unsharded(self, unsharded_view: torch.Tensor) -> None:
        """Create the persistent unsharded parameter over ``unsharded_view`` (padded rows)."""
        lay = self.layout
        padded = unsharded_view.view(lay.padded_shape(lay.rows_per_rank * self.world_size))
        value = padded.narrow(lay.dim, 0, lay.shape[lay.dim])
        if self.tp_spec is not None:  # the module sees its TP DTensor again
            value = DTensor(value, self.tp_spec, requires_grad=False)
        self.unsharded_param = nn.Parameter(value, requires_grad=self.sharded_param.requires_grad)
        if self.unsharded_grad_policy.explicit:  # Note [a parameter's grad_dtype]
            self.unsharded_param.grad_dtype = self.unsharded_grad_policy.dtype

    def register(self, tensor: torch.Tensor) -> None:
        """Make ``tensor`` the value every owning module sees under this parameter's name."""
        for ref in self.refs:
            ref.module._parameters[ref.name] = tensor

    def grad_rows(self, padded_grad_shard: torch.Tensor) -> torch.Tensor:
        """This rank's real rows of a reduced, padded gradient shard (a view)."""
        lay = self.layout
        return lay.valid(padded_grad_shard.view(lay.padded_shape(lay.rows_per_rank)))

    def sharded_grad(self, padded_grad_shard: torch.Tensor) -> DTensor:
        """Wrap this rank's reduced gradient rows as a DTensor matching the sharded param
        (in the rows' dtype, which a ``grad_dtype`` may make another than the param's)."""
        rows = self.grad_rows(padded_grad_shard)
        spec = self.spec
        if rows.dtype != spec.tensor_meta.dtype:
            spec = self._grad_specs.get(rows.dtype)
            if spec is None:
                spec = self._grad_specs[rows.dtype] = dataclasses.replace(
                    self.spec, tensor_meta=self.spec.tensor_meta._replace(dtype=rows.dtype))
        return DTensor(rows, spec, requires_grad=False)

    def written(self) -> int:
        """A count every in-place write of this rank's shard of the parameter raises: its
        local tensor's version counter (a write to it; each optimizer step,
        optim._mark_stepped: a DTensor made over a view of the flat shard keeps a counter
        of its own) and the DTensor parameter's own (an in-place op on the parameter,
        ``nn.init``, a load: a DTensor's op writes its local tensor below autograd, which
        counts nothing there)."""
        return self.sharded_param._local_tensor._version + self.sharded_param._version

    def local_is_shard(self) -> bool:
        """Whether the registered DTensor's local tensor is still this rank's rows of the
        padded shard (Note [one storage is the shard])."""
        local = self.sharded_param._local_tensor
        if self.extension is not None:
            return True  # each gather reads the local tensor itself
        if local.numel() == 0 or local.is_meta:
            return True  # nothing to send or update
        return local.data_ptr() == self.padded_shard.data_ptr()

    def __repr__(self) -> str:
        return f"ShardedParam({self.fqn}, shape={tuple(self.layout.shape)})"


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.device != b.device or a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.is_meta or b.is_meta or a.numel() == 0:
        return False  # nothing to compare; re-pointing the local tensor is harmless
    return a.data_ptr() == b.data_ptr() and a.stride() == b.stride()


# The registry: which tensors are fullshard's, the sharded parameters it made and the
# ones it replaced.
#
# Both are process-wide because the questions come from places that hold no unit: an
# optimizer's step hook sees only tensors (optim.py), and ``fully_shard`` must recognise
# a parameter another unit already replaced. Entries are keyed by ``id`` with weak
# references: tensors cannot be ``WeakKeyDictionary`` keys (their ``==`` is elementwise),
# and ``swap_tensors`` (used by ``Module._apply``) refuses tensors that are weakly
# referenced, so the weak reference goes to the owner (a ShardedParam), never the tensor.


class _Tracked(NamedTuple):
    owner: weakref.ref  # the ShardedParam that holds this DTensor as its sharded_param
    spec: object        # the DTensor's spec when tracked: tells a stale parameter apart


# id(sharded DTensor parameter) -> _Tracked. An entry outlives its parameter when
# something replaces the parameter (a load with assign=True): an optimizer still holding
# the old object is caught by stale_owner(), which compares the spec to tell the old
# object from a new tensor that happens to reuse its id.
_SHARDED: dict[int, _Tracked] = {}


# Called once, when the first sharded parameter is tracked: what must be installed
# process-wide for fullshard's parameters (the optimizer step hooks of optim.py) is
# installed then, by the first fully_shard, never by importing fullshard.
_ON_FIRST_TRACK: list = []


def on_first_track(install) -> None:
    """Run ``install()`` when the first sharded parameter is tracked (at once if one is)."""
    if _installed:
        install()
    else:
        _ON_FIRST_TRACK.append(install)


_installed = False


def track(owner) -> None:
    """Register ``owner.sharded_param`` (a ShardedParam's DTensor) for as long as
    ``owner`` lives."""
    global _installed
    if not _installed:
        _installed = True
        for install in _ON_FIRST_TRACK:
            install()
        _ON_FIRST_TRACK.clear()
    key = id(owner.sharded_param)

    def forget(ref: weakref.ref) -> None:
        entry = _SHARDED.get(key)
        if entry is not None and entry.owner is ref:
            del _SHARDED[key]

    _SHARDED[key] = _Tracked(weakref.ref(owner, forget), owner.sharded_param._spec)


def any_tracked() -> bool:
    """Whether this process holds any fullshard sharded parameter at all."""
    return bool(_SHARDED)


def owner_of(t: torch.Tensor):
    """The live ShardedParam whose current sharded parameter is ``t``, else None."""
    entry = _SHARDED.get(id(t))
    owner = entry.owner() if entry is not None else None
    return owner if owner is not None and owner.sharded_param is t else None


def stale_owner(t: torch.Tensor):
    """The ShardedParam that ``t`` *was* the sharded parameter of before something
    replaced it (the same object, judged by its spec), else None."""
    entry = _SHARDED.get(id(t))
    owner = entry.owner() if entry is not None else None
    if owner is None or owner.sharded_param is t or getattr(t, "_spec", None) is not entry.spec:
        return None
    return owner


def is_sharded_param(t: torch.Tensor) -> bool:
    """Whether ``t`` is a sharded parameter some fullshard unit registered (and holds)."""
    return owner_of(t) is not None


class OriginalOwners:
    """Original (pre-shard) parameter -> label of the unit that sharded it.

    After sharding, a module holds DTensors; the original ``nn.Parameter`` objects are
    dead unless something else still holds them: another module (a parameter shared
    across units), or an optimizer built before ``fully_shard`` (it would update
    tensors the model no longer uses). Both are errors, and this names the unit."""

    def __init__(self):
        self._owners: dict[int, tuple[weakref.ref, str]] = {}

    def add(self, param: nn.Parameter, label: str) -> None:
        key = id(param)
        self._owners[key] = (weakref.ref(param, lambda _r: self._owners.pop(key, None)), label)

    def get(self, param: nn.Parameter) -> str | None:
        entry = self._owners.get(id(param))
        return entry[1] if entry is not None and entry[0]() is param else None


SHARDED_ORIGINALS = OriginalOwners()
