"""A parameter's own ``grad_dtype``, followed where the installed torch's FSDP2 follows it.

Note [a parameter's grad_dtype]
From torch 2.15 a parameter may carry ``param.grad_dtype``, set explicitly (autograd then
accumulates its ``.grad`` in that dtype; ``None`` accepts any dtype), and torch's FSDP2
follows it. fullshard does the same, so a model moved between the two computes the same:

* the policy is read from the parameter given to ``fully_shard`` and, again, from the
  sharded parameter at lazy init (one set after ``fully_shard`` counts too); the sharded
  parameter carries it, and a parameter that replaces it (``_apply``,
  ``load_state_dict(assign=True)``) is given it, as torch's ``reset_sharded_param`` does;
* the sharded ``.grad`` comes back in ``grad_dtype`` (``None``: in the reduce dtype), cast
  once from the reduction's result; a ``.grad`` already there is added to after the cast;
* with ``MixedPrecisionPolicy(reduce_dtype=None)`` the unit reduces in the promotion of
  every trainable parameter's accumulation dtype: its ``grad_dtype`` (``None``: the
  compute dtype its gradient arrives in), else what the unit reduces in without one; a
  ``reduce_dtype`` set wins, and only the cast back follows ``grad_dtype``;
* without gradient sync, gradients accumulate in the accumulation dtype above
  (``reduce_dtype``, else ``grad_dtype``); an explicit ``grad_dtype`` no wider than the
  compute dtype is set on the unsharded parameter, so autograd accumulates in it there,
  while a wider one is applied when the gradient is laid out, as torch defers its upcast.

A parameter whose policy was never set explicitly keeps the behaviour of earlier
versions (Note [torch versions]): an unset ``grad_dtype`` follows the parameter's dtype,
and an explicit one equal to it differs only after a dtype conversion. Before 2.15 torch's
FSDP2 ignores the attribute, and so does fullshard (``read`` finds nothing explicit).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ...torch_version import FOLLOWS_PARAM_GRAD_DTYPE
from ..refusals.torch_errors import torch_first


@dataclass(frozen=True)
class GradDtype:
    """A parameter's ``grad_dtype`` policy: ``explicit`` when it was set (``dtype`` may
    then be None: any dtype), else the parameter's own dtype applies."""

    explicit: bool = False
    dtype: torch.dtype | None = None


UNSET = GradDtype()


def read(param: torch.Tensor) -> GradDtype:
    """``param``'s explicit ``grad_dtype`` where the installed torch's FSDP2 follows one."""
    if not FOLLOWS_PARAM_GRAD_DTYPE or not param._has_grad_dtype_override:
        return UNSET
    return GradDtype(True, param.grad_dtype)


def give(param: torch.Tensor, policy: GradDtype) -> None:
    """Set an explicit ``policy`` on ``param`` unless it has an explicit one of its own."""
    if policy.explicit and not read(param).explicit:
        param.grad_dtype = policy.dtype


def accumulation_dtype(policy: GradDtype, reduce_dtype: torch.dtype | None,
                       own_dtype: torch.dtype) -> torch.dtype | None:
    """What a gradient accumulates in before its reduction (torch's ``unsharded_grad_dtype``):
    the policy's ``reduce_dtype``, else an explicit ``grad_dtype``, else the parameter's own
    dtype; None: whatever dtype backward produces."""
    if reduce_dtype is not None:
        return reduce_dtype
    return policy.dtype if policy.explicit else own_dtype


def sharded_grad_dtype(policy: GradDtype, reduced_in: torch.dtype,
                       own_dtype: torch.dtype) -> torch.dtype:
    """The dtype of a parameter's sharded ``.grad`` after a reduction in ``reduced_in``."""
    if not policy.explicit:
        return own_dtype
    return policy.dtype or reduced_in


def sharded_grad_dtypes(group, trainable: list, reduce_dtype: torch.dtype,
                        unused_as_zeros: bool) -> list | None:
    """Each trainable parameter's sharded-gradient dtype after a reduction in
    ``reduce_dtype``, where an explicit ``grad_dtype`` makes one differ from the shard's;
    else None (the shard's dtype for all)."""
    if not any(p.grad_policy.explicit for p in trainable):
        return None
    if unused_as_zeros:
        refuse_unused_as_zeros(group)
    own = group.storage.dtype
    dtypes = [sharded_grad_dtype(p.grad_policy, reduce_dtype, own) for p in trainable]
    return None if all(d == own for d in dtypes) else dtypes


def accumulation_dtypes(group, trainable: list) -> list | None:
    """Each trainable parameter's accumulation dtype without gradient sync where the unit
    has an explicit ``grad_dtype``; else None (the unit's reduce dtype applies)."""
    if not any(p.grad_policy.explicit for p in trainable):
        return None
    reduce_dtype = _policy_reduce_dtype(group)
    return [accumulation_dtype(p.grad_policy, reduce_dtype, group.storage.dtype)
            for p in trainable]


def _policy_reduce_dtype(group) -> torch.dtype | None:
    """The ``reduce_dtype`` the unit's MixedPrecisionPolicy sets; None where it sets none."""
    policy = group.mp_policy
    return policy.reduce_dtype if policy is not None else None


def follow(group) -> None:
    """Read each parameter's ``grad_dtype`` policy from its sharded parameter and fit the
    unit's reduce dtype and unsharded parameters to it (Note [a parameter's grad_dtype]).
    ``group`` is a ParamGroup (core/group.py); nothing changes for a unit without an
    explicit policy."""
    for p in group.params:
        found = read(p.sharded_param)
        if found.explicit:
            p.grad_policy = found
        if p.grad_policy.explicit and p.extension is not None:
            raise NotImplementedError(
                f"fully_shard({group.unit_name}): parameter '{p.fqn}' has grad_dtype "
                f"{p.grad_policy.dtype} and is gathered beside the unit's flat buffers (a "
                "tensor subclass with its own all-gather, or kept in its own dtype by "
                "param_dtype_override_fn); fullshard follows grad_dtype for plain "
                "parameters only. Leave its grad_dtype unset, or set "
                "MixedPrecisionPolicy(reduce_dtype=...) for the unit's reductions.")
    trainable = group.trainable()
    if not any(p.grad_policy.explicit for p in trainable):
        return
    reduce_dtype = _policy_reduce_dtype(group)
    compute = group.compute_dtype
    if reduce_dtype is None:
        base = group.reduce_dtype or group.storage.dtype
        wanted = {(p.grad_policy.dtype or compute) if p.grad_policy.explicit else base
                  for p in trainable}
        group.reduce_dtype = functools.reduce(torch.promote_types, wanted)
    for p in trainable:
        if not p.grad_policy.explicit:
            continue
        dtype = accumulation_dtype(p.grad_policy, reduce_dtype, group.storage.dtype)
        # a wider one is applied when the gradients are laid out (torch defers the upcast)
        p.unsharded_grad_policy = (GradDtype(True, dtype)
                                   if dtype is None or dtype.itemsize <= compute.itemsize
                                   else UNSET)
        if p.unsharded_param is not None and p.unsharded_grad_policy.explicit:
            p.unsharded_param.grad_dtype = p.unsharded_grad_policy.dtype


def refuse_unused_as_zeros(group) -> None:
    """Raise where zeros for unused parameters have no dtype every rank agrees on: a
    ``grad_dtype=None`` parameter without a ``reduce_dtype`` (torch 2.15 refuses it too).
    It depends on the configuration only, so every rank raises together."""
    if _policy_reduce_dtype(group) is not None:
        return
    for p in group.trainable():
        if p.grad_policy.explicit and p.grad_policy.dtype is None:
            # torch's words first: callers match them (docs/errors.md E363)
            raise ValueError(torch_first(
                "Reducing unused parameters with grad_dtype=None requires an explicit "
                "MixedPrecisionPolicy.reduce_dtype so every rank can build zero gradients "
                f"of the same dtype: {p.fqn}. Set reduce_dtype to the dtype its gradients "
                "already have.",
                f"fully_shard({group.unit_name}): parameter '{p.fqn}' has grad_dtype=None "
                "and set_reduce_scatter_unused_params(True) reduces it as zeros where it is "
                "unused; give it a grad_dtype or the unit a "
                "MixedPrecisionPolicy(reduce_dtype=...)."))
