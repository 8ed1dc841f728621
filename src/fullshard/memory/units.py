"""Which modules become units and how their parameters are laid out per rank.

The estimator never calls ``fully_shard``: it needs no process group and keeps the
model on the meta device. It picks units the way ``fullshard.wrap.auto_wrap`` does
(every repeated block, or Hugging Face ``_no_split_modules`` block, then the root),
collects each unit's parameters the way ``fully_shard`` does (those of the module
not managed by a unit below it, tied parameters once), pads them into dim-0 shards
as ``ShardLayout`` does, and merges small adjacent units as the root does at its
first forward, with the same rule (core/schedule.py ``plan_runs`` and
``joins_bucket``; Note [buckets: units gather together] in core/buckets.py). Tensor-subclass
parameters (quantized weights: memory/weights.py) stay out of the flat buffers and their
units out of buckets, as at run time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch.nn as nn

from ..core.gradients import chunk_numel
from ..core.schedule import AfterForward, after_forward_rule, joins_bucket, plan_runs
from ..gpt import GroupedExperts
from ..wrap import ModuleWrapPolicy, apply_wrap_policy, repeated_block_classes
from .weights import WeightBytes


@dataclass(frozen=True)
class ParamShape:
    """One parameter as a unit sees it."""

    key: int          # id() of the parameter object in the traced model
    numel: int
    rows: int         # dim-0 size, the dimension fullshard shards
    trainable: bool
    subclass: WeightBytes | None = None  # a tensor-subclass parameter's bytes per element

    def shard_numel(self, shard_size: int) -> int:
        """Elements of this rank's padded dim-0 shard (Note [padded dim-0 shards])."""
        return math.ceil(self.rows / shard_size) * (self.numel // max(self.rows, 1))


@dataclass(frozen=True)
class GroupLayout:
    """What one collective moves: a unit, or a run of small units merged into one."""

    name: str
    units: tuple[int, ...]          # indices into the unit list, in module order
    params: tuple[ParamShape, ...]
    shard_size: int                 # ranks the parameters are sharded over
    is_root: bool
    after_forward: AfterForward     # its first unit's rule, as fully_shard keeps it
    offload: bool = False           # its units' CPUOffloadPolicy (cpu:FRACTION's blocks)

    @property
    def flat(self) -> tuple[ParamShape, ...]:
        """The parameters in the flat buffers (all but tensor-subclass ones)."""
        return tuple(p for p in self.params if p.subclass is None)

    @property
    def subclass(self) -> tuple[ParamShape, ...]:
        return tuple(p for p in self.params if p.subclass is not None)

    @property
    def shard_numel(self) -> int:
        """Elements of this rank's flat shard."""
        return sum(p.shard_numel(self.shard_size) for p in self.flat)

    @property
    def unsharded_numel(self) -> int:
        """Size of the gathered flat buffer (padded rows included)."""
        return self.shard_size * self.shard_numel

    def subclass_shard_bytes(self, param_dtype_bytes: int) -> float:
        """Bytes of this rank's tensor-subclass shards."""
        return sum(p.shard_numel(self.shard_size) * (p.subclass.shard or param_dtype_bytes)
                   for p in self.subclass)

    @property
    def subclass_send_bytes(self) -> int:
        """Bytes this rank sends in the tensor-subclass all-gather (its padded shards'
        all-gather inputs); the gathered ones are ``shard_size`` times as many."""
        return math.ceil(sum(p.shard_numel(self.shard_size) * p.subclass.gathered
                             for p in self.subclass))

    @property
    def trainable(self) -> tuple[ParamShape, ...]:
        return tuple(p for p in self.params if p.trainable)

    @property
    def grad_numel(self) -> int:
        """Unsharded gradient elements autograd accumulates (unpadded)."""
        return sum(p.numel for p in self.trainable)

    @property
    def reduce_numel(self) -> int:
        """Per-rank elements of the reduce-scatter (Note [a reduction's chunk])."""
        return chunk_numel([p.shard_numel(self.shard_size) for p in self.trainable])


def find_units(model: nn.Module, split_experts: bool = False) -> list[nn.Module]:
    """The modules ``auto_wrap`` shards, children first, then the root (last); with
    ``split_experts`` each mixture of experts' grouped experts first, a unit of their
    own as under expert parallelism (Note [expert parallelism in the trainer])."""
    classes = repeated_block_classes(model)
    chosen = apply_wrap_policy(model, ModuleWrapPolicy(classes), lambda _m: None) \
        if classes else []
    experts = [m for m in model.modules() if isinstance(m, GroupedExperts)] \
        if split_experts else []
    return [*experts, *chosen, model]


def unit_params(units: list[nn.Module]) -> list[list[nn.Parameter]]:
    """Each unit's own parameters: under its module, not under a unit nested in it."""
    unit_ids = {id(u) for u in units}
    owned: list[list[nn.Parameter]] = []
    seen: set[int] = set()
    for unit in units:  # children first, so a nested unit claims its parameters first
        params: list[nn.Parameter] = []
        stack = [unit]
        while stack:
            module = stack.pop()
            for p in module._parameters.values():
                if p is not None and id(p) not in seen:
                    seen.add(id(p))
                    params.append(p)
            stack.extend(c for c in module._modules.values()
                         if c is not None and id(c) not in unit_ids)
        owned.append(params)
    return owned


def layout_groups(units: list[nn.Module], shard_size: int,
                  reshard_after_forward: bool | int, bucket_numel: int,
                  subclass: dict[int, WeightBytes] | None = None, ep: int = 1,
                  offloaded: frozenset[int] = frozenset()) -> list[GroupLayout]:
    """Groups in module order (root first), small adjacent units merged as fullshard does.
    ``reshard_after_forward`` is fully_shard's argument for every unit but the root,
    which gets ``None`` (as from ``auto_wrap``); ``subclass`` gives the bytes of the
    tensor-subclass parameters, by ``id``. With ``ep`` > 1 a unit of grouped experts holds
    ``1/ep`` of each expert tensor's rows, sharded over ``shard_size / ep`` ranks, and
    stays a group of its own (on its own mesh: nothing merges across meshes). The units
    whose indices are in ``offloaded`` keep their states on the host, and merge only with
    each other (core/buckets.py)."""
    subclass = subclass or {}
    params = unit_params(units)
    order = sorted(range(len(units)), key=_module_order(units))
    root = len(units) - 1
    split = [ep if isinstance(u, GroupedExperts) else 1 for u in units]
    shapes = [tuple(ParamShape(id(p), p.numel() // split[i],
                               (p.shape[0] if p.dim() else 1) // split[i], p.requires_grad,
                               subclass.get(id(p)))
                    for p in params[i]) for i in range(len(units))]
    singles = [GroupLayout(type(units[i]).__name__, (i,), shapes[i], shard_size // split[i],
                           i == root,
                           after_forward_rule(None if i == root else reshard_after_forward,
                                              shard_size // split[i]), i in offloaded)
               for i in order if shapes[i]]
    # Units with tensor-subclass parameters keep their own group (core/buckets.py), as do
    # experts split over ranks.
    def alone(g: GroupLayout) -> bool:
        return bool(g.subclass) or split[g.units[0]] > 1

    runs = plan_runs([g for g in singles if not alone(g)], lambda g: g.unsharded_numel,
                     lambda first, g: joins_bucket(first.after_forward, first.is_root,
                                                   g.after_forward)
                   and first.offload == g.offload, bucket_numel)
    runs += [[g] for g in singles if alone(g)]
    position = {g.units[0]: n for n, g in enumerate(singles)}
    runs.sort(key=lambda run: position[run[0].units[0]])
    return [run[0] if len(run) == 1 else _merged(run) for run in runs]


def _module_order(units: list[nn.Module]):
    position = {id(m): n for n, m in enumerate(units[-1].modules())}
    return lambda i: position[id(units[i])]


def _merged(run: list[GroupLayout]) -> GroupLayout:
    """One group for a run of units (core/buckets.py merge_small_units): the first's
    shard group and rule, every member's parameters in order."""
    first = run[0]
    return GroupLayout(f"{first.name}..{run[-1].name}", tuple(u for g in run for u in g.units),
                       tuple(p for g in run for p in g.params), first.shard_size, first.is_root,
                       first.after_forward, first.offload)
