"""Model states per rank in the ZeRO paper's accounting (Rajbhandari et al., Table 1).

Mixed-precision Adam keeps, per parameter, 2 bytes of fp16 parameters, 2 bytes of
fp16 gradients and K = 12 bytes of optimizer state (fp32 master copy, momentum,
variance). Stage 1 shards the optimizer state, stage 2 also the gradients, stage 3
also the parameters; stage 0 is plain data parallelism. Activations, buffers and
fragmentation are outside this accounting: ``estimate`` covers them.
"""

from __future__ import annotations

PARAM_BYTES = 2
GRAD_BYTES = 2
OPTIMIZER_BYTES = 12  # K in the paper


def zero_model_state_bytes(num_params: float, world_size: int, stage: int,
                           optimizer_bytes: int = OPTIMIZER_BYTES) -> float:
    """Bytes of model states per rank for ZeRO ``stage`` (0-3)."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage}")
    shards = {  # (params, grads, optimizer states) divided by the world size?
        0: (False, False, False), 1: (False, False, True),
        2: (False, True, True), 3: (True, True, True)}[stage]
    total = 0.0
    for nbytes, sharded in zip((PARAM_BYTES, GRAD_BYTES, optimizer_bytes), shards):
        total += nbytes * num_params / (world_size if sharded else 1)
    return total


def zero_table(num_params: float, world_size: int) -> dict[int, float]:
    """Stage -> bytes per rank, as in the paper's Table 1 row for (Psi, N_d)."""
    return {stage: zero_model_state_bytes(num_params, world_size, stage) for stage in range(4)}


def format_zero_table(num_params: float, world_size: int) -> str:
    rows = zero_table(num_params, world_size)
    names = {0: "data parallel (no sharding)", 1: "stage 1 (optimizer states)",
             2: "stage 2 (+ gradients)", 3: "stage 3 (+ parameters)"}
    lines = [f"model states per rank, {num_params:.4g} parameters, {world_size} ranks "
             f"(bytes/param {PARAM_BYTES}+{GRAD_BYTES}+{OPTIMIZER_BYTES}, GB = 1e9)"]
    lines += [f"  {names[s]:<30} {b / 1e9:>10.3f} GB" for s, b in rows.items()]
    return "\n".join(lines)
