"""``project``: step time, tokens/s per device, MFU, exposed communication and memory per
rank for one model, strategy and cluster; ``rank_configurations``: every configuration
that fits, fastest first.

Note [what the projection models]
Compute: compute.py's model of each kind of kernel (Note [the compute model]: matrix
multiplies as a roofline of their shapes, attention at its own rate, elementwise work and
the loss at memory bandwidth, a per-unit overhead, checkpointing as the forward it runs
again), with constants fitted to published runs; or, with ``Device.efficiency`` set (a
calibrated CPU, ``--efficiency``), executed FLOPs at one fraction of peak, CPU ranks beyond
the machine's cores sharing them.
Communication: comm.py's ring model per collective, over NVLink inside a node and the
network as soon as a group spans nodes; with expert parallelism (``Settings.ep``), a
block's experts gathered over the efsdp ranks only and its tokens sent to them and back
by all-to-all, on the compute's path (costs.py). Overlap: timeline.py replays fullshard's real issue
order and prefetch; with accumulation, fullshard's trainer reduces after the last
micro-batch only (``Settings.sync_micro_batches`` for runs that reduce after each).
Optimizer: AdamW streams 28 bytes per parameter of the local shard (read parameter,
gradient, two moments; write three) through device memory.
Memory per rank (footprint.py): fp32 parameter, gradient and two AdamW moments per local
shard element; the gathered units the schedule holds at once (two units under full_shard,
every unit under shard_grad_op); activations per token of each block (elements kept for
backward: 3·d + 2·q + 2·kv + 4·f for a SwiGLU block, 2·f for a GELU one's MLP, in the
compute dtype; the block input only for a checkpointed block, plus one block's worth in
recomputation; half of them under selective checkpointing); the loss (12 bytes per token
and vocabulary entry: fp32 log-softmax and two gradients; 4 for a fused loss); and, when
fullshard accumulates without reducing, an unsharded reduce-dtype gradient per parameter.
It is coarser than ``fullshard estimate`` (which replays the buffer schedule on the real
model) and is meant for sizing clusters, not for the last gigabyte: on the two published
runs that report their peak memory it came within 2% (docs/projection.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

from .compute import FITTED, KernelConstants
from .costs import shard_ranks, unit_costs
from .footprint import memory_per_rank
from .hardware import Cluster, ProjectionError
from .settings import CHECKPOINTING, QUANTIZE, STRATEGIES, Settings
from .shapes import ModelShape
from .timeline import StepTime, step_time

__all__ = ["CHECKPOINTING", "QUANTIZE", "STRATEGIES", "Projection", "Settings",
           "memory_per_rank", "project", "rank_configurations", "train_flags"]

QUANTIZE_GAIN = 0.05  # the speed-up quantized communication must bring to be ranked first
ADAMW_BYTES_PER_PARAM = 28


@dataclass(frozen=True)
class Projection:
    model: str
    device: str
    world_size: int
    per_node: int
    settings: Settings
    time: StepTime
    tokens_per_step_per_rank: int
    model_flops_per_token: float
    peak_flops: float
    memory_bytes: int
    device_memory_bytes: int

    @property
    def tokens_per_second_per_device(self) -> float:
        return self.tokens_per_step_per_rank / self.time.seconds

    @property
    def mfu(self) -> float:
        return self.tokens_per_second_per_device * self.model_flops_per_token / self.peak_flops

    def fits(self, margin: float = 0.10) -> bool:
        return self.memory_bytes * (1 + margin) <= self.device_memory_bytes

    def row(self) -> dict:
        s = self.settings
        return {"model": self.model, "device": self.device, "world_size": self.world_size,
                "strategy": s.strategy, "checkpointing": s.checkpointing,
                "quantize": s.quantize,
                "batch": s.batch, "grad_accum": s.grad_accum, "seq": s.seq,
                "step_s": self.time.seconds, "tokens_per_s_per_device":
                    self.tokens_per_second_per_device, "mfu": self.mfu,
                "exposed_comm_s": self.time.exposed, "comm_s": self.time.communication,
                "memory_gib": self.memory_bytes / 2**30}


def project(shape: ModelShape, cluster: Cluster, settings: Settings | None = None,
            constants: KernelConstants = FITTED) -> Projection:
    """Step time, throughput, MFU and memory of ``shape`` trained on ``cluster``;
    ``constants``: the compute model's (compute.FITTED unless refitting)."""
    s = settings or Settings()
    if 0 < shape.learned_positions < s.seq:
        raise ProjectionError(f"sequence length {s.seq} exceeds the {shape.learned_positions} "
                              f"positions of the {shape.name} model's position table; use "
                              f"{shape.learned_positions} or less")
    if s.strategy == "hybrid_shard" and cluster.nodes == 1:
        raise ProjectionError("hybrid_shard shards inside a node and replicates across "
                              f"nodes; {cluster.world_size} ranks fit one node of "
                              f"{cluster.per_node}: use full_shard")
    dev = cluster.device
    shard, _, _ = shard_ranks(cluster, s.strategy)
    optimizer = ADAMW_BYTES_PER_PARAM * shape.num_params / shard / dev.memory_bandwidth
    last, early = unit_costs(shape, cluster, s, constants)
    time = step_time(last, s.grad_accum, optimizer, dev.overlaps_comm, early)
    return Projection(shape.name, dev.name, cluster.world_size, cluster.per_node, s, time,
                      s.batch * s.seq * s.grad_accum, shape.model_flops_per_token(s.seq),
                      dev.peak_flops, memory_per_rank(shape, cluster, s), dev.memory_bytes)


def _micro_batches(batch: int) -> Iterator[int]:
    """Micro-batches that split ``batch`` exactly, largest first (accumulation keeps the
    batch the step was asked for)."""
    return (micro for micro in range(batch, 0, -1) if batch % micro == 0)


def rank_configurations(shape: ModelShape, cluster: Cluster, *, batch: int, seq: int,
                        margin: float = 0.10, strategies: tuple[str, ...] = STRATEGIES,
                        checkpointing: tuple[str, ...] = ("none", "full"),
                        quantize: tuple[str, ...] = ("none",),
                        ) -> tuple[list[Projection], list[Projection]]:
    """(configurations that fit, fastest first; those that do not). ``batch`` is the
    sequences per rank per optimizer step; smaller micro-batches that divide it reach it by
    accumulation (fullshard's: unsharded gradients kept between reductions).
    The default checkpointing choices are the ones ``fullshard train`` runs (per block,
    none or all, reducing in fp32); "selective" is torchtitan's, for projecting its runs.
    ``quantize`` adds int8 communication choices (``weights,grads``) to each sharded
    configuration."""
    fits, over = [], []
    for strategy in strategies:
        if strategy == "hybrid_shard" and cluster.nodes == 1:
            continue
        for ac in checkpointing:
            for q in quantize:
                if q != "none" and strategy == "no_shard":
                    continue
                for micro in _micro_batches(batch):
                    p = project(shape, cluster, Settings(strategy, micro, seq, batch // micro,
                                                         ac, quantize=q))
                    (fits if p.fits(margin) else over).append(p)
    # int8 communication rounds what is gathered and reduced: rank it first only when it
    # is more than QUANTIZE_GAIN faster than full precision
    fits.sort(key=lambda p: -p.tokens_per_second_per_device / (
        1.0 if p.settings.quantize == "none" else 1.0 + QUANTIZE_GAIN))
    over.sort(key=lambda p: p.memory_bytes)
    return fits, over


def train_flags(p: Projection, model: str) -> str:
    """The ``fullshard train`` flags that run a projected configuration of ``model`` (a
    preset name, or ``hf:PATH`` for a Hugging Face checkpoint of the projected shape)."""
    s = p.settings
    if s.checkpointing == "selective":
        raise ProjectionError("fullshard train checkpoints whole blocks: project selective "
                              "checkpointing, but plan with none or full")
    source = f"--model {model}" if model.startswith("hf:") else f"--preset {model}"
    flags = [source, f"--nproc {p.per_node}"]
    if p.world_size > p.per_node:
        flags.append(f"--nnodes {p.world_size // p.per_node}")
    flags.append(f"--parallel.strategy {s.strategy}")
    if s.strategy == "hybrid_shard":
        flags.append(f"--parallel.replicas {p.world_size // p.per_node}")
    flags += [
              f"--parallel.activation_checkpointing {str(s.checkpointing != 'none').lower()}",
              f"--batch.batch_size {s.batch}", f"--batch.grad_accum {s.grad_accum}",
              f"--batch.seq_len {s.seq}", "--parallel.precision bf16"]
    if s.quantize != "none":
        flags.append(f"--parallel.quantize {s.quantize}")
    return " ".join(flags)
