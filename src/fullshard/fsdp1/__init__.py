"""The FSDP1 front: ``FullyShardedDataParallel`` and its option types."""

from .module import FSDP, FullyShardedDataParallel
from .options import (BackwardPrefetch, CPUOffload, FullOptimStateDictConfig,
                      FullStateDictConfig, LocalOptimStateDictConfig, LocalStateDictConfig,
                      MixedPrecision, OptimStateDictConfig, ShardedOptimStateDictConfig,
                      ShardedStateDictConfig, ShardingStrategy, StateDictConfig,
                      StateDictSettings, StateDictType)

__all__ = [
    "FullyShardedDataParallel", "FSDP", "ShardingStrategy", "BackwardPrefetch",
    "MixedPrecision", "CPUOffload", "StateDictType", "StateDictConfig", "FullStateDictConfig",
    "ShardedStateDictConfig", "LocalStateDictConfig", "OptimStateDictConfig",
    "FullOptimStateDictConfig", "ShardedOptimStateDictConfig", "LocalOptimStateDictConfig",
    "StateDictSettings",
]
