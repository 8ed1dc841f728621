"""Each unit's seconds in one micro-batch: its compute (compute.py, or one flat efficiency)
and its collectives (comm.py), as the timeline (timeline.py) replays them."""

from __future__ import annotations

from dataclasses import replace

from .comm import collective_seconds
from .compute import (FITTED, KernelConstants, PassSeconds, block_seconds, eager_share,
                      embedding_seconds, head_seconds, rates_for)
from .hardware import Cluster, ProjectionError
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


def expert_ranks(shape: ModelShape, cluster: Cluster, s: Settings) -> tuple[int, int]:
    """(ranks a block's experts are split over, ranks each expert is sharded over): with
    ``Settings.ep``, ``ep`` consecutive ranks of each shard group hold different experts
    and the group's other dimension shards each of them (torchtitan's efsdp)."""
    shard, _, _ = shard_ranks(cluster, s.strategy)
    if s.ep == 1:
        return 1, shard
    if not shape.n_experts:
        raise ProjectionError(f"--ep {s.ep} splits a mixture of experts' experts over ranks; "
                              f"{shape.name} has no experts: leave --ep at 1")
    if shape.n_experts % s.ep or shard % s.ep:
        raise ProjectionError(f"--ep {s.ep} must divide both the {shape.n_experts} experts "
                              f"of {shape.name} and the {shard} ranks each unit is sharded "
                              f"over under {s.strategy}")
    return s.ep, shard // s.ep


def experts_gathered(shape: ModelShape, s: Settings) -> int:
    """The expert parameters of one block a rank gathers over its efsdp ranks under expert
    parallelism (its ``1/ep`` of them); 0 without."""
    return shape.n_experts * shape.mlp_matrix_params // s.ep if s.ep > 1 else 0


def gathered_params(shape: ModelShape, cluster: Cluster, s: Settings) -> list[int]:
    """Parameters each unit's all-gather assembles on a rank: under expert parallelism a
    block gathers its dense part and only its ``1/ep`` of the experts (an ``ep`` that does
    not fit is refused, expert_ranks)."""
    expert_ranks(shape, cluster, s)
    params = unit_params(shape)
    away = experts_gathered(shape, s) * (s.ep - 1)
    return [params[0]] + [n - away for n in params[1:-1]] + [params[-1]]


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
    if dev.efficiency is None and dev.arch != "cpu" and dev.arch not in constants.matmul:
        raise ProjectionError(
            f"{dev.name}: no published run in the data has fitted the compute rates of its "
            f"architecture ({dev.arch}); give --efficiency E (the fraction of its peak a run "
            f"of yours reached) or time your model on one: fullshard project --calibrate "
            f"--gpu {dev.name}")
    if dev.efficiency is not None or dev.arch not in constants.matmul:
        return _flat(shape, cluster, s)
    rates = rates_for(dev.peak_flops, dev.memory_bandwidth, dev.arch, constants)
    tokens = s.batch * s.seq
    block, full, selective = block_seconds(shape, tokens, s.seq, rates, constants, s.attention,
                                           fused=s.fused_blocks)
    blocks = []
    for i in range(shape.n_layers):
        again = full if s.checkpointed(i) else (
            selective if s.checkpointing == "selective" else 0.0)
        # a fully checkpointed block launches its forward's kernels again (block.overhead
        # is three forwards' launches: one forward, two backward)
        blocks.append(PassSeconds(block.forward, block.backward, again,
                                  block.overhead * (4 / 3 if s.checkpointed(i) else 1.0)))
    # a whole compiled model fuses the final norm and the units' launches outside the blocks
    whole = s.compile == "model"
    return [embedding_seconds(shape, tokens, rates,
                              rates.overhead * eager_share(constants, whole))] + blocks \
        + [head_seconds(shape, tokens, rates, constants, compiled=whole)]


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
    ep, efsdp = expert_ranks(shape, cluster, s)
    # an all-to-all between nodes leaves each rank through its own NIC (no ring to spread)
    ep_link = cluster.link_for(True, ranks_per_node=1) \
        if ep > min(cluster.per_node, cluster.world_size) else cluster.link_for(False)
    # the efsdp ranks of a group are ep apart: a node holds per_node / ep of them
    efsdp_link = cluster.link_for(
        spans, ranks_per_node=max(1, min(cluster.per_node, cluster.world_size) // ep))
    # tokens to their top_k experts and the results back, in the compute dtype
    routed = s.batch * s.seq * shape.mlps_per_token * shape.d_model * s.param_bytes
    costs = []
    for i, (work, n) in enumerate(zip(compute_seconds(shape, cluster, s, constants), params)):
        block = 0 < i < last
        # under expert parallelism a block's experts (1/ep of them here) are gathered and
        # reduced over the efsdp ranks, the rest of it over the whole shard group
        experts = experts_gathered(shape, s) if block else 0
        dense = n - experts * ep
        gather = collective_seconds("all_gather", dense * gather_bytes, shard, link) \
            + collective_seconds("all_gather", experts * gather_bytes, efsdp, efsdp_link)
        if "weights" in words:  # quantize the shard, dequantize what was gathered
            gather += (n / shard + dense + experts) * (s.param_bytes + 1) / dev.memory_bandwidth
        # the root stays gathered through backward (torch's rule for the root), and so does
        # every unit under shard_grad_op; the last unit's backward follows its forward
        keeps = i == 0 or i == last or s.strategy == "shard_grad_op"
        if s.strategy == "no_shard":
            reduce = collective_seconds("all_reduce", n * s.reduce_bytes, cluster.world_size,
                                        world_link)
            replica = 0.0
        else:
            reduce = collective_seconds("reduce_scatter", dense * reduce_bytes, shard, link) \
                + collective_seconds("reduce_scatter", experts * reduce_bytes, efsdp,
                                     efsdp_link)
            if "grads" in words:
                reduce += 2 * (dense + experts) * (s.reduce_bytes + 1) / dev.memory_bandwidth
            replica = collective_seconds("all_reduce", n * s.reduce_bytes / shard, replicas,
                                         replica_link)
        dispatch = 2 * collective_seconds("all_to_all", routed, ep, ep_link) \
            if block and ep > 1 else 0.0
        costs.append(UnitCost(forward=work.forward, backward=work.backward + work.recompute,
                              gather=gather, regather=0.0 if keeps else gather,
                              reduce=reduce, replica_reduce=replica, dispatch=dispatch,
                              overhead=work.overhead))
    if s.sync_micro_batches or s.grad_accum == 1:
        return costs, costs
    # the gradient (param dtype) read, the accumulator (reduce dtype) read and written
    add = (s.param_bytes + 2 * s.reduce_bytes) / dev.memory_bandwidth
    return costs, [replace(u, backward=u.backward + n * add, reduce=0.0, replica_reduce=0.0)
                   for u, n in zip(costs, params)]
