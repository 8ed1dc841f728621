"""Where test ranks compute: the CPU with gloo, or one GPU per rank with NCCL."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from ..core.comm import set_one_rank_shortcuts


def uses_cuda(backend: str) -> bool:
    """Whether a process-group backend ("gloo", "nccl", "cpu:gloo,cuda:nccl") runs on GPUs."""
    return "nccl" in backend


def visible_gpus() -> int:
    """The CUDA devices this process may use (0 without CUDA or with it hidden)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def check_gpus_for_ranks(world_size: int) -> None:
    """NCCL ranks each need a GPU of their own: say so before starting any."""
    n = visible_gpus()
    if world_size <= n:
        return
    shown = os.environ.get("CUDA_VISIBLE_DEVICES")
    where = "" if shown is None else f" (CUDA_VISIBLE_DEVICES={shown!r})"
    fix = (f"pass world_size={n} or less" if n else "run where GPUs are")
    raise ValueError(f"run_distributed: backend='nccl' puts each of the world_size={world_size} "
                     f"ranks on a GPU of its own, but {n} {'GPU is' if n == 1 else 'GPUs are'} "
                     f"visible{where}; {fix}, or pass backend='gloo' to run the ranks on the "
                     "CPU.")


def rank_device() -> torch.device:
    """Inside ``run_distributed``: the device this rank computes on (its GPU with NCCL)."""
    if dist.is_initialized() and uses_cuda(str(dist.get_backend())):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def collectives_at_one_rank(enabled: bool = True) -> bool:
    """Make shard groups of one rank communicate as larger ones do (NCCL and gloo both
    take a group of one rank) instead of copying (Note [shard groups of one rank]): the
    gathers and reductions, the copy stream, its events and the pooled buffers then run
    on a one-GPU machine. For tests and benchmarks; call it in each process before it
    shards anything (every rank function of a test). Returns the previous setting."""
    return not set_one_rank_shortcuts(not enabled)
