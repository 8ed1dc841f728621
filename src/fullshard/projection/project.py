"""``project``: step time, tokens/s per device, MFU, exposed communication and memory per
rank for one model, strategy and cluster; ``rank_configurations``: every configuration
that fits, fastest first.

Note [what the projection models]
Compute: each unit's executed FLOPs (shapes.py; activation checkpointing adds its
recomputation: "full" one more forward of every block, "selective" — torchtitan's op
policy, which saves every other matmul's output — half of the blocks' forward matmuls) at
``peak_flops x efficiency`` of the device. CPU ranks beyond the machine's cores share them.
Communication: comm.py's ring model per collective, over NVLink inside a node and the
network as soon as a group spans nodes. Overlap: timeline.py replays fullshard's real issue
order and prefetch. Optimizer: AdamW streams 28 bytes per parameter of the local shard
(read parameter, gradient, two moments; write three) through device memory.
Memory per rank: fp32 parameter, gradient and two AdamW moments per local shard element;
the gathered units the schedule holds at once (two units under full_shard, every unit
under shard_grad_op); and activations per token of each block (elements kept for
backward: 5·d + 2·kv + 4·f for a SwiGLU block, 5·d + 2·kv + 2·f for a GELU one, in the
compute dtype; the block input only under full checkpointing, plus one block's worth in
recomputation; half of them under selective checkpointing), plus fp32 logits and their
gradient. It is coarser than ``fullshard estimate`` (which replays the buffer schedule on
the real model) and is meant for sizing clusters, not for the last gigabyte.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

from .comm import collective_seconds
from .hardware import Cluster, ProjectionError
from .shapes import ModelShape
from .timeline import StepTime, UnitCost, step_time

STRATEGIES = ("full_shard", "shard_grad_op", "hybrid_shard", "no_shard")
CHECKPOINTING = ("none", "selective", "full")
QUANTIZE = ("none", "weights", "grads", "weights,grads")
INT8_WIRE_BYTES = 1 + 4 / 256  # int8 plus an fp32 scale per 256 elements
QUANTIZE_GAIN = 0.05  # the speed-up quantized communication must bring to be ranked first
ADAMW_BYTES_PER_PARAM = 28
STATE_BYTES_PER_PARAM = 16  # fp32 parameter, gradient, two moments


@dataclass(frozen=True)
class Settings:
    strategy: str = "full_shard"
    batch: int = 1                 # sequences per rank per micro-batch
    seq: int = 2048
    grad_accum: int = 1
    checkpointing: str = "none"
    param_bytes: int = 2           # compute dtype of gathered parameters (bf16)
    reduce_bytes: int = 4          # gradient reduction dtype (fp32)
    quantize: str = "none"         # int8 all-gathers / reduce-scatters (--parallel.quantize)

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ProjectionError(f"strategy must be one of {', '.join(STRATEGIES)}, "
                                  f"got {self.strategy!r}")
        if self.quantize not in QUANTIZE:
            raise ProjectionError(f"quantize must be one of {', '.join(QUANTIZE)}, got "
                                  f"{self.quantize!r}")
        if self.quantize != "none" and self.strategy == "no_shard":
            raise ProjectionError("quantize applies to all-gathers and reduce-scatters, "
                                  "which no_shard does not issue")
        if self.checkpointing not in CHECKPOINTING:
            raise ProjectionError(f"activation checkpointing must be one of "
                                  f"{', '.join(CHECKPOINTING)}, got {self.checkpointing!r}")
        for name in ("batch", "seq", "grad_accum", "param_bytes", "reduce_bytes"):
            if getattr(self, name) < 1:
                raise ProjectionError(f"{name} must be positive, got {getattr(self, name)}")


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


def _shard_ranks(cluster: Cluster, strategy: str) -> tuple[int, bool, int]:
    """(ranks a unit is sharded over, whether that group spans nodes, replicas)."""
    if strategy == "no_shard":
        return 1, False, cluster.world_size
    if strategy == "hybrid_shard":
        within = min(cluster.per_node, cluster.world_size)
        return within, False, cluster.world_size // within
    return cluster.world_size, cluster.nodes > 1, 1


def _unit_params(shape: ModelShape) -> list[int]:
    """Parameters per fullshard unit: root (embedding, and a tied head), blocks, tail."""
    tail = shape.head_params + shape.d_model
    return [shape.embedding_params] + [shape.block_params] * shape.n_layers + [tail]


def _unit_costs(shape: ModelShape, cluster: Cluster, s: Settings) -> list[UnitCost]:
    dev = cluster.device
    tokens = s.batch * s.seq
    rate = dev.peak_flops * dev.efficiency
    if dev.cores:  # CPU ranks beyond the cores share them
        rate /= max(1.0, min(cluster.per_node, cluster.world_size) / dev.cores)
    shard, spans, replicas = _shard_ranks(cluster, s.strategy)
    link = cluster.link_for(spans)
    world_link = cluster.link_for(cluster.nodes > 1)
    replica_link = cluster.link_for(True, ranks_per_node=1)
    block_fwd = shape.block_forward_flops(s.seq)
    recompute = {"none": 0.0, "full": block_fwd,
                 "selective": shape.block_matrix_params}[s.checkpointing]
    flops = [0.0] + [block_fwd] * shape.n_layers + [shape.head_forward_flops]
    extra = [0.0] + [recompute] * shape.n_layers + [0.0]
    params = _unit_params(shape)
    last = len(params) - 1
    # Note [quantized communication]: int8 on the wire, plus the (de)quantizing passes
    # through device memory: the gather quantizes the shard and dequantizes the unit, the
    # reduce quantizes the unit's gradients and dequantizes and sums the shard's copies
    words = s.quantize.split(",")
    gather_bytes = INT8_WIRE_BYTES if "weights" in words else s.param_bytes
    reduce_bytes = INT8_WIRE_BYTES if "grads" in words else s.reduce_bytes
    costs = []
    for i, (fwd, again, n) in enumerate(zip(flops, extra, params)):
        gather = collective_seconds("all_gather", n * gather_bytes, shard, link)
        if "weights" in words:
            gather += (n / shard + n) * (s.param_bytes + 1) / dev.memory_bandwidth
        # the root stays gathered through backward (torch's rule for the root), and so does
        # every unit under shard_grad_op; the last unit's backward follows its forward
        keeps = i == 0 or i == last or s.strategy == "shard_grad_op"
        if s.strategy == "no_shard":
            reduce = collective_seconds("all_reduce", n * s.reduce_bytes, cluster.world_size,
                                        world_link)
            replica = 0.0
        else:
            reduce = collective_seconds("reduce_scatter", n * reduce_bytes, shard, link)
            if "grads" in words:
                reduce += 2 * n * (s.reduce_bytes + 1) / dev.memory_bandwidth
            replica = collective_seconds("all_reduce", n * s.reduce_bytes / shard, replicas,
                                         replica_link)
        costs.append(UnitCost(forward=tokens * fwd / rate,
                              backward=tokens * (2 * fwd + again) / rate,
                              gather=gather, regather=0.0 if keeps else gather,
                              reduce=reduce, replica_reduce=replica))
    return costs


def memory_per_rank(shape: ModelShape, cluster: Cluster, s: Settings) -> int:
    """Note [what the projection models], memory."""
    shard, _, _ = _shard_ranks(cluster, s.strategy)
    params = _unit_params(shape)
    states = STATE_BYTES_PER_PARAM * shape.num_params / shard
    if s.strategy in ("shard_grad_op", "no_shard"):
        gathered = shape.num_params * s.param_bytes
    else:
        gathered = 2 * max(params) * s.param_bytes + max(params) * s.reduce_bytes
    d, f, kv = shape.d_model, shape.ffn_hidden, shape.kv_width
    per_token = 5 * d + 2 * kv + (4 if shape.gated_mlp else 2) * f
    tokens = s.batch * s.seq
    act = 2  # bytes of the compute dtype
    block = tokens * per_token * act
    if s.checkpointing == "full":
        activations = shape.n_layers * tokens * d * act + block
    elif s.checkpointing == "selective":
        activations = shape.n_layers * block / 2
    else:
        activations = shape.n_layers * block
    logits = 2 * tokens * shape.vocab_size * 4
    return int(states + gathered + activations + logits)


def project(shape: ModelShape, cluster: Cluster, settings: Settings | None = None) -> Projection:
    s = settings or Settings()
    if s.strategy == "hybrid_shard" and cluster.nodes == 1:
        raise ProjectionError("hybrid_shard shards inside a node and replicates across "
                              f"nodes; {cluster.world_size} ranks fit one node of "
                              f"{cluster.per_node}: use full_shard")
    dev = cluster.device
    shard, _, _ = _shard_ranks(cluster, s.strategy)
    optimizer = ADAMW_BYTES_PER_PARAM * shape.num_params / shard / dev.memory_bandwidth
    time = step_time(_unit_costs(shape, cluster, s), s.grad_accum, optimizer,
                     dev.overlaps_comm)
    return Projection(shape.name, dev.name, cluster.world_size, cluster.per_node, s, time,
                      s.batch * s.seq * s.grad_accum, shape.model_flops_per_token(s.seq),
                      dev.peak_flops, memory_per_rank(shape, cluster, s), dev.memory_bytes)


def _micro_batches(batch: int) -> Iterator[int]:
    while batch >= 1:
        yield batch
        batch //= 2


def rank_configurations(shape: ModelShape, cluster: Cluster, *, batch: int, seq: int,
                        margin: float = 0.10, strategies: tuple[str, ...] = STRATEGIES,
                        checkpointing: tuple[str, ...] = ("none", "full"),
                        quantize: tuple[str, ...] = ("none",),
                        ) -> tuple[list[Projection], list[Projection]]:
    """(configurations that fit, fastest first; those that do not). ``batch`` is the
    sequences per rank per optimizer step; smaller micro-batches reach it by accumulation.
    The default checkpointing choices are the ones ``fullshard train`` runs (per block,
    full); "selective" is torchtitan's, for projecting its runs. ``quantize`` adds int8
    communication choices (``weights,grads``) to each sharded configuration."""
    fits, over = [], []
    for strategy in strategies:
        if strategy == "hybrid_shard" and cluster.nodes == 1:
            continue
        for ac in checkpointing:
            for q in quantize:
                if q != "none" and strategy == "no_shard":
                    continue
                for micro in _micro_batches(batch):
                    p = project(shape, cluster, Settings(strategy, micro, seq,
                                                         -(-batch // micro), ac, quantize=q))
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
