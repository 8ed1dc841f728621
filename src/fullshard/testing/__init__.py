"""Multi-process test harness and parity helpers (gloo on CPU, NCCL on GPUs)."""

from .devices import collectives_at_one_rank, rank_device, visible_gpus
from .harness import run_distributed
from .ports import free_port

__all__ = ["run_distributed", "rank_device", "visible_gpus", "free_port",
           "collectives_at_one_rank"]
