"""fullshard: Fully Sharded Data Parallel training for PyTorch.

``fully_shard`` is a drop-in for ``torch.distributed.fsdp.fully_shard``::

    from fullshard import fully_shard, FSDPModule
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)

and ``FullyShardedDataParallel`` (``FSDP``) for torch's FSDP1 wrapper::

    from fullshard import FullyShardedDataParallel as FSDP, ShardingStrategy
    model = FSDP(model, auto_wrap_policy=policy, sharding_strategy=ShardingStrategy.FULL_SHARD)
"""

from . import torch_version  # noqa: F401 - first: refuses a torch older than supported
from .api import fully_shard, register_fsdp_forward_method, share_comm_ctx
from . import optim  # noqa: F401 - the local-shard optimizer step, installed by a first fully_shard
from .whole_matrix import register_whole_matrix_optimizer
from .fsdp_module import FSDPModule, GradientReductionHandle, UnshardHandle
from .grad_norm import clip_grad_norm_
from .overlapped_step import OverlappedStep
from .captured import CapturedStep, CaptureError, capture_step
from .torch_names import InstallOrderWarning, install, uninstall
from .activation_checkpointing import apply_activation_checkpointing
from .fsdp1 import (FSDP, BackwardPrefetch, CPUOffload, FullOptimStateDictConfig,
                    FullStateDictConfig, FullyShardedDataParallel, MixedPrecision,
                    ShardedOptimStateDictConfig, ShardedStateDictConfig, ShardingStrategy,
                    StateDictType)
from .policies import (CPUOffloadPolicy, DataParallelMeshDims, DiskOffloadPolicy,
                       MixedPrecisionPolicy, OffloadPolicy)

__all__ = [
    "fully_shard",
    "register_fsdp_forward_method",
    "share_comm_ctx",
    "clip_grad_norm_",
    "OverlappedStep",
    "capture_step",
    "CapturedStep",
    "CaptureError",
    "register_whole_matrix_optimizer",
    "install",
    "uninstall",
    "InstallOrderWarning",
    "DataParallelMeshDims",
    "apply_activation_checkpointing",
    "FSDPModule",
    "UnshardHandle",
    "GradientReductionHandle",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "CPUOffloadPolicy",
    "DiskOffloadPolicy",
    "FullyShardedDataParallel",
    "FSDP",
    "ShardingStrategy",
    "BackwardPrefetch",
    "MixedPrecision",
    "CPUOffload",
    "StateDictType",
    "FullStateDictConfig",
    "ShardedStateDictConfig",
    "FullOptimStateDictConfig",
    "ShardedOptimStateDictConfig",
]

__version__ = "0.1.0"
