"""A parameter's own ``grad_dtype``: refused where torch's FSDP2 follows it and fullshard
does not.

Note [a parameter's grad_dtype]
torch 2.15's FSDP2 reads ``param.grad_dtype`` set before the first forward (on the
parameter before ``fully_shard`` or on the sharded one after it): the sharded gradient
comes back in that dtype, and with ``reduce_dtype=None`` the reduction runs in it (fp32
gradients for bf16 parameters; ``None`` takes whatever dtype backward produces).
fullshard's gradients are always in the parameter's own dtype, reduced in
``reduce_dtype`` (Note [torch versions]). Going on would hand back gradients in another
dtype than torch's without a sign, so from torch 2.15 a parameter whose ``grad_dtype``
is not its own dtype is refused by name, at ``fully_shard`` and at the first forward.
Before 2.15 torch's FSDP2 ignores the attribute, and so does fullshard (the same
gradients as torch there). ``MixedPrecisionPolicy(reduce_dtype=torch.float32)`` is the
setting that gives fp32 reductions on either.
"""

from __future__ import annotations

import torch

from ...torch_version import FOLLOWS_PARAM_GRAD_DTYPE


def refuse_grad_dtype_override(label: str, fqn: str, param: torch.Tensor) -> None:
    """Raise, naming the parameter, when the installed torch's FSDP2 would follow a
    ``grad_dtype`` of ``param`` that differs from its dtype (Note [a parameter's
    grad_dtype])."""
    if not FOLLOWS_PARAM_GRAD_DTYPE or param.grad_dtype == param.dtype:
        return
    raise NotImplementedError(
        f"fully_shard({label}): parameter '{fqn}' has grad_dtype {param.grad_dtype} "
        f"(its dtype is {param.dtype}); torch {torch.__version__}'s FSDP2 returns and "
        "reduces its gradient in that dtype, fullshard in the parameter's own. Leave "
        "grad_dtype unset and use MixedPrecisionPolicy(reduce_dtype=torch.float32) for "
        "fp32 reductions.")
