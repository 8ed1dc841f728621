"""The installed torch, read once, and what fullshard does differently for each version.

Note [torch versions]
fullshard follows the FSDP2 semantics of the torch it runs with, so code that moves
from torch's ``fully_shard`` to fullshard computes the same thing on the torch it has.
Supported: torch 2.11 to 2.15 (each tested: docs/torch-versions.md); an older torch is
refused at import. The differences handled, each named by a constant below:

* ``REDUCE_IN_GRAD_DTYPE`` (2.15): ``MixedPrecisionPolicy(reduce_dtype=None)`` reduces
  gradients in the parameter's own dtype (fp32 for fp32 parameters), no longer in
  ``param_dtype``; gradients accumulated without sync (``set_requires_gradient_sync(
  False)``) are accumulated in that dtype too. Before 2.15 both happen in ``param_dtype``.
* ``FOLLOWS_PARAM_GRAD_DTYPE`` (2.15): torch's FSDP2 follows a parameter's own
  ``grad_dtype``, and so does fullshard (Note [a parameter's grad_dtype]).
* Names added in 2.15 exist in fullshard on every supported version, with 2.15's
  behaviour: ``MixedPrecisionPolicy.param_dtype_override_fn``,
  ``FSDPModule.finalize_backward`` and ``GradientReductionHandle``,
  ``set_manual_backward_finalization``, ``set_keep_unsharded_storage``.
* torch 2.10 and later name the flat collectives ``all_gather_single`` /
  ``reduce_scatter_single`` (core/comm.py takes whichever exists).

Private torch names fullshard still uses, each because no public API does the job at the
cost the hot path allows (``tests/test_torch_version.py`` checks every one on the
installed torch and fails naming the torch version and the name if a release changes it):

* ``DTensor(local, spec, requires_grad=)`` with a ``DTensorSpec`` from
  ``torch.distributed.tensor._dtensor_spec``, and reading or replacing ``._local_tensor``
  / ``._spec``: a sharded parameter's DTensor is a view of the unit's flat shard, made
  and re-pointed without copying (``DTensor.from_local`` copies metadata checks per call
  and cannot re-point an existing parameter; ``to_local()`` is an autograd op).
* ``torch._chunk_cat(out=)``: gradients laid out rank-major, cast and padded in one
  kernel, into a pooled buffer (FSDP2 uses it the same way).
* ``Variable._execution_engine.queue_callback``: the end-of-backward callback (FSDP2's
  too; autograd has no public "backward finished" hook).
* ``torch.utils._pytree``: flattening module inputs and outputs (no public pytree).
* ``torch.autograd.profiler._is_profiler_enabled``: profiler ranges cost nothing when no
  profiler runs.
* ``torch.utils._python_dispatch.TorchDispatchMode`` and
  ``aten._scaled_dot_product_flash_attention_for_cpu``: the memory estimator traces one
  step's allocations op by op on the meta device.
* ``torch.distributed.checkpoint._nested_dict.flatten_state_dict``: DCP's own key layout,
  to name checkpoint keys exactly as DCP stores them.
* ``torch.distributed._composable.contract._get_registry``: whether torch's own
  ``fully_shard`` sharded a module (core/refusals/torch_fsdp.py refuses mixing the two by name).
* ``torch.distributed.fsdp._fully_shard._fsdp_init._get_managed_modules`` (or the same
  name in ``_fully_shard``, where a torch calls it from there): while ``install()`` is in
  effect a guard there refuses, by name, torch's ``fully_shard`` over fullshard units.
* ``Tensor._has_grad_dtype_override`` (2.15 on): whether ``grad_dtype`` was set, which its
  value cannot tell (an explicit one equal to the dtype, or ``None``); torch's FSDP2 reads
  it to decide which parameters' policy to follow (Note [a parameter's grad_dtype]).
"""

from __future__ import annotations

import re

import torch

OLDEST = (2, 11)


def _parse(text: str) -> tuple[int, int]:
    """``"2.15.0+cu130"`` -> ``(2, 15)``."""
    found = re.match(r"(\d+)\.(\d+)", text)
    if found is None:
        raise ImportError(f"fullshard: cannot read torch's version {text!r}")
    return int(found[1]), int(found[2])


VERSION = _parse(torch.__version__)

if VERSION < OLDEST:
    raise ImportError(
        f"fullshard needs torch {OLDEST[0]}.{OLDEST[1]} or newer; torch {torch.__version__} "
        f"is installed. Upgrade it: pip install 'torch>={OLDEST[0]}.{OLDEST[1]}'")

REDUCE_IN_GRAD_DTYPE = VERSION >= (2, 15)
FOLLOWS_PARAM_GRAD_DTYPE = VERSION >= (2, 15)
