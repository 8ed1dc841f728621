"""From ``[parallel]`` to ``fully_shard`` calls: the mesh, resharding, dtypes, recomputation.

Strategies map to fully_shard arguments as FSDP1's ``ShardingStrategy`` does:

=============  ========================================  =====================
strategy       mesh                                      reshard_after_forward
=============  ========================================  =====================
full_shard     1-D, all ranks                            True
shard_grad_op  1-D, all ranks                            False
hybrid_shard   2-D (replicas, world / replicas)          True
no_shard       2-D (world, 1): shard groups of one rank  (nothing to gather)
=============  ========================================  =====================

On a (replicate, shard) mesh fullshard shards within the shard dimension and
all-reduces gradients across the replicate one, so shard groups of size one are plain
data parallelism: every rank holds every parameter and gradients are averaged.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ..activation_checkpointing import apply_activation_checkpointing
from ..policies import MixedPrecisionPolicy
from ..wrap import auto_wrap, repeated_block_classes
from .config import ConfigError, ParallelConfig

COMPUTE_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def build_mesh(parallel: ParallelConfig, device_type: str, world: int,
               ranks_per_node: int) -> DeviceMesh:
    """The device mesh ``parallel.strategy`` shards over."""
    if parallel.strategy in ("full_shard", "shard_grad_op"):
        return init_device_mesh(device_type, (world,), mesh_dim_names=("shard",))
    if parallel.strategy == "no_shard":
        replicas = world
    else:
        replicas = parallel.replicas or max(1, world // ranks_per_node)
        if world % replicas:
            raise ConfigError(f"parallel.replicas: {replicas} does not divide the world size "
                              f"{world}")
    return init_device_mesh(device_type, (replicas, world // replicas),
                            mesh_dim_names=("replicate", "shard"))


def reshard_after_forward(parallel: ParallelConfig) -> bool | int:
    """The explicit setting, else the strategy's (only shard_grad_op keeps parameters)."""
    if parallel.reshard_after_forward is not None:
        return parallel.reshard_after_forward
    return parallel.strategy != "shard_grad_op"


def mixed_precision(precision: str) -> MixedPrecisionPolicy:
    """Gather and compute in the chosen dtype, reduce gradients in fp32 (fp32 shards)."""
    dtype = COMPUTE_DTYPES[precision]
    if dtype is None:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)


def shard_model(model: nn.Module, parallel: ParallelConfig, mesh: DeviceMesh) -> nn.Module:
    """Checkpoint activations per block if asked, then make every repeated block (GPT
    ``Block``s, a Hugging Face model's ``_no_split_modules``) a unit, then the root."""
    if parallel.activation_checkpointing:
        blocks = tuple(repeated_block_classes(model))
        apply_activation_checkpointing(model, lambda m: isinstance(m, blocks))
    return auto_wrap(model, mesh=mesh, reshard_after_forward=reshard_after_forward(parallel),
                     mp_policy=mixed_precision(parallel.precision))
