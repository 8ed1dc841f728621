"""Each unit's seconds in one micro-batch: its compute (compute.py, or one flat efficiency)
and its collectives (comm.py), as the timeline (timeline.py) replays them."""

from __future__ import annotations

from dataclasses import replace

from .comm import collective_seconds
from .compute import (FITTED, KernelConstants, PassSeconds, block_seconds, embedding_seconds,
                      head_seconds, rates_for)
from .hardware import Cluster
from .settings import Settings
from .shapes import ModelShape
from .timeline import UnitCost

INT8_WIRE_BYTES = 1 + 4 / 256  # int8 plus an fp32 scale per 256 elements


def shard_ranks(cluster: Cluster, strategy: str) -> tuple[int, bool, int]:
    """(ranks a unit is sharded over, whether that group spans nodes, replicas)."""
    if strategy == "no_shard":
        return 1, False, cluster.world_size
    if strategy == "hybrid_shard":
        within = min(cluster.per_node, cluster.world_size)
        return within, False, cluster.world_size // within
    return cluster.world_size, cluster.nodes > 1, 1


def unit_params(shape: ModelShape) -> list[int]:
    """Parameters per fullshard unit: root (embedding, and a tied head), blocks, tail."""
    tail = shape.head_params + shape.d_model
    return [shape.embedding_params] + [shape.block_params] * shape.n_layers + [tail]


def _flat(shape: ModelShape, cluster: Cluster, s: Settings) -> list[PassSeconds]:
    """Executed FLOPs at one achieved fraction of peak (``Device.efficiency``; a device
    without fitted constants, 1): what a calibrated CPU measures, and what
    ``--efficiency`` asks for."""
    dev = cluster.device
    tokens = s.batch * s.seq
    rate = dev.peak_flops * (1.0 if dev.efficiency is None else dev.efficiency)
    if dev.cores:  # CPU ranks beyond the cores share them
        rate /= max(1.0, min(cluster.per_node, cluster.world_size) / dev.cores)
    block = shape.block_forward_flops(s.seq)
    out = [PassSeconds(0.0, 0.0, 0.0)]
    for i in range(shape.n_layers):
        again = block if s.checkpointed(i) else (
            shape.block_active_matrix_params if s.checkpointing == "selective" else 0.0)
        out.append(PassSeconds(tokens * block / rate, 2 * tokens * block / rate,
                               tokens * again / rate))
    head = shape.head_forward_flops
    return out + [PassSeconds(tokens * head / rate, 2 * tokens * head / rate, 0.0)]


def compute_seconds(shape: ModelShape, cluster: Cluster, s: Settings,
                    constants: KernelConstants = FITTED) -> list[PassSeconds]:
    """Each unit's compute in one micro-batch (Note [the compute model])."""
    dev = cluster.device
    if dev.efficiency is not None or dev.arch not in constants.matmul:
        return _flat(shape, cluster, s)
    rates = rates_for(dev.peak_flops, dev.memory_bandwidth, dev.arch, constants)
    tokens = s.batch * s.seq
    block, full, selective = block_seconds(shape, tokens, s.seq, rates, constants)
    blocks = []
    for i in range(shape.n_layers):
        again = full if s.checkpointed(i) else (
            selective if s.checkpointing == "selective" else 0.0)
        blocks.append(PassSeconds(block.forward, block.backward, again))
    return [embedding_seconds(shape, tokens, rates)] + blocks \
        + [head_seconds(shape, tokens, rates, constants)]


def unit_costs(shape: ModelShape, cluster: Cluster, s: Settings,
               constants: KernelConstants = FITTED) -> tuple[list[UnitCost], list[UnitCost]]:
    """Compute and collectives of every unit in the last micro-batch of a step, and in the
    ones before it (the same when every micro-batch reduces; else without reductions, and
    with the unsharded gradients added to their accumulators, Settings.sync_micro_batches)."""
    dev = cluster.device
    shard, spans, replicas = shard_ranks(cluster, s.strategy)
    link = cluster.link_for(spans)
    world_link = cluster.link_for(cluster.nodes > 1)
    replica_link = cluster.link_for(True, ranks_per_node=1)
    params = unit_params(shape)
    last = len(params) - 1
    # Note [quantized communication]: int8 on the wire, plus the (de)quantizing passes
    # through device memory: the gather quantizes the shard and dequantizes the unit, the
    # reduce quantizes the unit's gradients and dequantizes and sums the shard's copies
    words = s.quantize.split(",")
    gather_bytes = INT8_WIRE_BYTES if "weights" in words else s.param_bytes
    reduce_bytes = INT8_WIRE_BYTES if "grads" in words else s.reduce_bytes
    costs = []
    for i, (work, n) in enumerate(zip(compute_seconds(shape, cluster, s, constants), params)):
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
        costs.append(UnitCost(forward=work.forward, backward=work.backward + work.recompute,
                              gather=gather, regather=0.0 if keeps else gather,
                              reduce=reduce, replica_reduce=replica))
    if s.sync_micro_batches or s.grad_accum == 1:
        return costs, costs
    # the gradient (param dtype) read, the accumulator (reduce dtype) read and written
    add = (s.param_bytes + 2 * s.reduce_bytes) / dev.memory_bandwidth
    return costs, [replace(u, backward=u.backward + n * add, reduce=0.0, replica_reduce=0.0)
                   for u, n in zip(costs, params)]
