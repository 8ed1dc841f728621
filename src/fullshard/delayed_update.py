"""The delayed update: ``OverlappedStep(optimizer, delayed=True)``.

Note [the delayed update]
Exact ``OverlappedStep`` (Note [the host step overlapped with the next forward]) still
makes each offloaded unit's gather wait for that unit's host step, so a host step longer
than forward plus backward (an fp32 AdamW on the host for a large model) still stalls the
device. ZeRO-Offload's one-step delayed parameter update (DPU; Ren et al., "ZeRO-Offload:
Democratizing Billion-Scale Model Training", USENIX ATC '21, section 5.2) stops waiting:
the host applies step t's gradients while forward and backward of step t+1 run on the
parameters as they were before step t's update. The paper turns it on only after a number
of ordinary warm-up steps (early gradients change fast; it reports a training curve that
barely moves with DPU after 40 warm-up iterations of BERT-large); DeepSpeed's released
ZeRO-Offload does not ship it (its maintainers point to a separate research branch).

What fullshard does, per CPU-offloaded unit stepped on the host thread: ``step()`` t
first waits for the host steps of step t-1, steps the parameters kept on the device at
once (never delayed), then for each offloaded unit copies its flat shard into a host
buffer of its own (``core.features.pending_shard.PendingShard``: 4 bytes a parameter in fp32, one
host memcpy per step) and hands the update to the host thread. Until the next ``step()``
every gather of the unit (forward, backward's re-gather, an explicit ``unshard()``) reads
that copy and waits for nothing; the host thread writes the shard and the optimizer
states alone. The unit's gradients go with the step: the next backward writes a second
buffer (two are kept for small units, Note [persistent sharded gradients]). With
parameters θ_0 at the start and the update U applied in order,

    g_t = ∇L_t(θ_{t-2})   for t > delay_after + 1,
    g_t = ∇L_t(θ_{t-1})   for t <= delay_after + 1 (the warm-up, and the first step),
    θ_t = U(θ_{t-1}, g_t),

for the offloaded units; the first ``delay_after`` steps are exact (their next forward
waits, as exact ``OverlappedStep``). The effect on convergence is that of one-step-stale
gradients (the update applied at t was computed at the parameters of t-2): a small change
for a well-tuned learning rate past the warm-up, larger early in training or with large
learning rates; it is not the same run as an exact one, only one with the same update rule
on stale gradients.

A clip coefficient or GradScaler flag set on the optimizer (``grad_scale``, ``found_inf``)
is fine: step t's coefficient is known at ``step()`` t, from step t's gradients, and is
frozen with the hyperparameters for the host step. Stepping during backward is not
(``stepping_in_backward`` hands a unit out before ``step()`` has taken its copy), nor are
units offloaded to disk (their host step stays exact: a delayed unit's copy of its shard
in host memory is what disk offload is there to avoid).

What reads parameters sees: ``state_dict()`` of the module (and checkpoints) waits for the
host steps and holds θ_t, the updated parameters, beside the optimizer's states after
step t; ``wait()`` finishes the host steps but leaves the copy in place (the next forward
still computes with θ_{t-1}); loading the module's parameters drops the copy (the next
forward computes with what was loaded); ``catch_up()`` finishes the host steps and drops
the copies, so the next forward computes with θ_t (that step is then an exact one).

A resume continues exactly in either of two ways. ``delayed_state_dict()`` holds the step
count and the copies as DTensors shaped like the parameters (this rank's shards, at this
world size), and ``load_delayed_state_dict()``, called after the module and the optimizer
are loaded, puts them back: the resumed run is the uninterrupted one, step for step. Or
the save is an exact point: ``catch_up()`` at each checkpoint, in the run that goes on and
in the one resumed from it alike, and the checkpoint needs nothing beyond the module's and
the optimizer's states (at any world size). The trainer does the latter, also at each
evaluation and sample, so what it reports is θ_t and costs one host step's wait each time.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from .core.group import ParamGroup
from .core.param import owner_of
from .core.state import unit_of
from .policies import DiskOffloadPolicy


def check_delay_after(delay_after, delayed: bool) -> None:
    """Refuse a ``delay_after`` that is no count of steps, or one given without ``delayed``."""
    if (isinstance(delay_after, bool) or not isinstance(delay_after, int) or delay_after < 0
            or (delay_after and not delayed)):
        raise ValueError(
            f"fullshard.OverlappedStep: delay_after={delay_after!r} must be a whole number "
            ">= 0 of exact steps before the delayed update starts, given with delayed=True.")


def refuse_disk_offload(optimizer: torch.optim.Optimizer) -> None:
    """The delayed update keeps a copy of each delayed unit's shard in host memory for the
    next forward to read; disk offload is there to keep the host free of what it can
    page out, so its units are not delayed (their exact step runs on the host thread)."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            owner = owner_of(p)
            if owner is not None and isinstance(owner.offload, DiskOffloadPolicy):
                raise ValueError(
                    f"fullshard.OverlappedStep(delayed=True): parameter {owner.fqn} is "
                    "offloaded to disk (DiskOffloadPolicy), whose step is not delayed (a "
                    "delayed unit keeps a second copy of its shard in host memory); offload "
                    "it with CPUOffloadPolicy, or use "
                    "OverlappedStep without delayed=True.")


def _offloaded_params(optimizer: torch.optim.Optimizer, groups: dict[int, ParamGroup]):
    """Each CPU-offloaded parameter of ``optimizer`` with its key ``"param group
    index.position"`` and its live group (``groups``: the live groups by ShardedParam id)."""
    for index, param_group in enumerate(optimizer.param_groups):
        for position, p in enumerate(param_group["params"]):
            group = _group_of(p, groups)
            if group is not None:
                yield f"{index}.{position}", p, group


def distinct(groups) -> list[ParamGroup]:
    """``groups`` without repeats, in their order (a group appears once per parameter)."""
    return list(dict.fromkeys(groups))


def pending_views(optimizer: torch.optim.Optimizer, groups: dict[int, ParamGroup]) -> dict:
    """Each parameter of ``optimizer`` whose unit's gathers read a copy now, as the key
    ``"param group index.position"`` and a DTensor of that copy shaped like the
    parameter (``groups``: the live groups by ShardedParam id)."""
    views = {}
    for key, p, group in _offloaded_params(optimizer, groups):
        if group.reads_pending:
            local = group.delayed.view_of(p._local_tensor, group.storage)
            views[key] = DTensor.from_local(local, p.device_mesh, p.placements, shape=p.shape,
                                            stride=p.stride(), run_check=False)
    return views


def load_pending(optimizer: torch.optim.Optimizer, groups: dict[int, ParamGroup],
                 pending: dict) -> None:
    """Put copies saved by ``pending_views`` back: every unit of ``optimizer`` gathers its
    copy (or its shard where none was saved) until the next ``step()``."""
    known = {key: (p, group) for key, p, group in _offloaded_params(optimizer, groups)}
    saved = {}  # key -> the saved copy's local tensor, checked against its parameter
    for key, value in pending.items():
        local = value.to_local() if isinstance(value, DTensor) else value
        p = known.get(key, (None, None))[0]
        if p is None or tuple(local.shape) != tuple(p._local_tensor.shape):
            raise ValueError(
                f"fullshard.OverlappedStep.load_delayed_state_dict: entry {key!r} (local "
                f"shape {tuple(local.shape)}) matches no CPU-offloaded parameter shard of "
                "this optimizer; load the state saved from an optimizer over the same "
                "parameters, in the same order, at the same world size.")
        saved[key] = local
    for group in distinct(g for _p, g in known.values()):
        group.stop_delayed_read()
    started = set()
    for key, (p, group) in known.items():
        if key not in saved:
            continue
        if group not in started:
            group.start_delayed_read()  # the shard as loaded, for parameters not saved
            started.add(group)
        group.delayed.view_of(p._local_tensor, group.storage).copy_(saved[key])


def _group_of(p: torch.Tensor, groups: dict[int, ParamGroup]) -> ParamGroup | None:
    """The live group of a CPU-offloaded parameter ``p``; None for any other."""
    owner = owner_of(p)
    if owner is None or owner.offload is None or isinstance(owner.offload, DiskOffloadPolicy):
        return None
    return groups.get(id(owner))


def read_copies_of(stepped: dict[ParamGroup, list], groups: dict[int, ParamGroup]) -> None:
    """Gathers of each group in ``stepped`` (about to be handed to the host thread) read a
    copy of its shard taken now; every other group of ``groups`` (the live ones by
    ShardedParam id) reads its shard again, no step of it running. A unit with
    tensor-subclass parameters, which gather on their own, waits for its step instead."""
    if any(g.compute_device.type == "cuda" for g in stepped):
        torch.cuda.synchronize()  # the copy-ins of the last forward and backward read them
    for group in distinct(groups.values()):
        if group in stepped and group.subclass is None:
            group.start_delayed_read()
        else:
            group.stop_delayed_read()


def stop_delayed_read(module: nn.Module, _incompatible) -> None:
    """A load_state_dict post hook: the loaded parameters of ``module``'s unit are what its
    next gather reads."""
    unit = unit_of(module)
    if unit is not None and unit.group is not None:
        unit.group.stop_delayed_read()
