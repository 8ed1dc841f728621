"""fullshard: Fully Sharded Data Parallel training for PyTorch.

``fully_shard`` is a drop-in for ``torch.distributed.fsdp.fully_shard``::

    from fullshard import fully_shard, FSDPModule
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
"""

from .api import FSDPModule, UnshardHandle, fully_shard, register_fsdp_forward_method
from .checkpointing import apply_activation_checkpointing
from .policies import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

__all__ = [
    "fully_shard",
    "register_fsdp_forward_method",
    "apply_activation_checkpointing",
    "FSDPModule",
    "UnshardHandle",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "CPUOffloadPolicy",
]

__version__ = "0.1.0"
