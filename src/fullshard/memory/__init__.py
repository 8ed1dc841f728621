"""Memory: estimate a rank's peak before training, plan a configuration, track it live.

    from fullshard.memory import estimate, plan, MemoryTracker
    print(estimate("gpt2-124m", world_size=8, batch_size=8, seq_len=1024).table())

See docs/memory.md for the model of memory behind the numbers.
"""

from .allocator import tune_cpu_allocator
from .estimate import MemoryEstimate, estimate
from .plan import Plan, plan
from .tracker import MemoryTracker, fullshard_buffer_bytes
from .zero_table import zero_model_state_bytes, zero_table

__all__ = ["MemoryEstimate", "MemoryTracker", "Plan", "estimate", "fullshard_buffer_bytes",
           "plan", "tune_cpu_allocator", "zero_model_state_bytes", "zero_table"]
