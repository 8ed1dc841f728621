"""Each unit's costs (projection/costs.py) under expert parallelism: a share of the
experts gathered and reduced, the all-to-alls on the compute's path, and what does not
divide refused."""

from __future__ import annotations

import pytest

from fullshard.projection import (DEVICES, SHAPES, Cluster, Link, ModelShape, ProjectionError,
                                  Settings, memory_per_rank, project)
from fullshard.projection.comm import collective_seconds
from fullshard.projection.timeline import UnitCost, step_time

from support.catalogue import matches_documented


MIXTRAL = ModelShape("mixtral-8x7b", 4096, 32, 32, 8, 14336, 32000, False, True,
                     n_experts=8, top_k=2)


def test_expert_parallelism_gathers_a_share_of_the_experts_and_pays_all_to_alls():
    """--ep N: a block gathers and reduces its dense part over the shard group and 1/N of
    its experts over the efsdp ranks; four all-to-alls of its routed tokens per step sit
    on the compute's path; the gathered buffer shrinks by the experts left out."""
    from fullshard.projection.costs import unit_costs
    link = Link(bandwidth=100e9, latency=1e-5)
    dev = DEVICES["h100"].with_overrides(intra=link, inter=Link(10e9, 2e-5))
    one_node, two_nodes = Cluster(dev, 8, 8), Cluster(dev, 16, 8)
    shape, tokens = MIXTRAL, 4096
    experts = shape.n_experts * shape.mlp_matrix_params
    dense = shape.block_params - experts
    for ep in (2, 4, 8):
        plain, _ = unit_costs(shape, one_node, Settings("full_shard", 1, tokens))
        split, _ = unit_costs(shape, one_node, Settings("full_shard", 1, tokens, ep=ep))
        block, before = split[1], plain[1]
        assert block.forward == before.forward and block.backward == before.backward
        assert block.gather == pytest.approx(
            collective_seconds("all_gather", 2 * dense, 8, link)
            + collective_seconds("all_gather", 2 * experts / ep, 8 // ep, link))
        assert block.gather < before.gather
        assert block.reduce == pytest.approx(
            collective_seconds("reduce_scatter", 4 * dense, 8, link)
            + collective_seconds("reduce_scatter", 4 * experts / ep, 8 // ep, link))
        routed = tokens * 2 * 4096 * 2  # top-2 tokens of d_model values in bf16
        a2a = (ep - 1) * link.latency + (ep - 1) / ep * routed / link.bandwidth
        assert block.dispatch == pytest.approx(2 * a2a)
        assert split[0] == plain[0] and split[-1] == plain[-1]  # embedding, head
        # the memory column: the two gathered blocks and one unsharded gradient shrink
        away = experts * (ep - 1) // ep
        assert memory_per_rank(shape, one_node, Settings("full_shard", 1, tokens)) \
            - memory_per_rank(shape, one_node, Settings("full_shard", 1, tokens, ep=ep)) \
            == pytest.approx((2 * 2 + 4) * away, abs=1)
    # beyond a node the all-to-all leaves each rank through its own NIC
    sixteen = ModelShape("16 experts", 4096, 32, 32, 8, 14336, 32000, False, True,
                         n_experts=16, top_k=2)
    wide, _ = unit_costs(sixteen, two_nodes, Settings("full_shard", 1, tokens, ep=16))
    assert wide[1].dispatch == pytest.approx(
        2 * (15 * 2e-5 + 15 / 16 * tokens * 2 * 4096 * 2 / 10e9))
    # EP 8 over two nodes: each expert's 2 efsdp ranks sit on different nodes, one of
    # them per node, so their ring runs at one NIC's rate, not the node's
    wide, _ = unit_costs(shape, two_nodes, Settings("full_shard", 1, tokens, ep=8))
    nic = Link(10e9, 2e-5)
    node = Link(min(link.bandwidth, 8 * 10e9), 2e-5)
    assert wide[1].gather == pytest.approx(
        collective_seconds("all_gather", 2 * dense, 16, node)
        + collective_seconds("all_gather", 2 * experts / 8, 2, nic))
    # the step: the all-to-alls are communication nobody hides
    settings = Settings("full_shard", 1, tokens, ep=8)
    costs, _ = unit_costs(shape, one_node, settings)
    got = project(shape, one_node, settings)
    without = step_time([UnitCost(u.forward, u.backward, u.gather, u.regather, u.reduce,
                                  u.replica_reduce) for u in costs], 1, 0.0, True)
    dispatch = sum(2 * u.dispatch for u in costs)
    with_dispatch = step_time(costs, 1, 0.0, True)
    assert got.time.communication == pytest.approx(with_dispatch.communication)
    assert with_dispatch.compute == pytest.approx(without.compute)  # not compute
    assert with_dispatch.communication - dispatch == pytest.approx(without.communication)
    assert with_dispatch.exposed >= dispatch  # on the compute's path: never hidden
    assert step_time(costs, 1, 0.0, False).seconds == pytest.approx(
        step_time(costs, 1, 0.0, False).compute + without.communication + dispatch)


def test_expert_parallelism_that_does_not_fit_is_refused():
    with pytest.raises(ProjectionError, match=r"--ep 2 splits .* llama3-8b has no experts"):
        project(SHAPES["llama3-8b"], Cluster(DEVICES["h100"], 8, 8),
                Settings("full_shard", 1, 4096, ep=2))
    for ranks, ep, strategy in ((8, 3, "full_shard"), (8, 16, "full_shard"),
                                (16, 16, "hybrid_shard"), (8, 2, "no_shard")):
        with pytest.raises(ProjectionError, match=f"--ep {ep} must divide both the 8 experts"):
            project(MIXTRAL, Cluster(DEVICES["h100"], ranks, 8),
                    Settings(strategy, 1, 4096, ep=ep))
    with pytest.raises(ProjectionError, match="ep must be positive"):
        Settings("full_shard", 1, 4096, ep=0)


@pytest.mark.parametrize("name", ["b200", "mi300x"])
def test_a_device_no_published_run_fitted_needs_an_efficiency_or_a_calibration(name):
    # its datasheet (memory, bandwidth, links) is there; its kernels' rates are not: no
    # silent 100% of peak, and no Hopper or Ampere constants borrowed
    dev = DEVICES[name]
    with pytest.raises(ProjectionError) as err:
        project(SHAPES["llama3-70b"], Cluster(dev, 64, 8), Settings("full_shard", 1, 4096))
    message = f"ProjectionError: {err.value}"
    assert matches_documented("E393", message) and f"--gpu {name}" in message, message
    given = project(SHAPES["llama3-70b"], Cluster(dev.with_overrides(efficiency=0.4), 64, 8),
                    Settings("full_shard", 1, 4096))
    h100 = project(SHAPES["llama3-70b"], Cluster(DEVICES["h100"].with_overrides(
        efficiency=0.4), 64, 8), Settings("full_shard", 1, 4096))
    # at one efficiency, the faster peak computes faster; the larger memory holds more
    assert given.time.compute < h100.time.compute
    assert given.memory_bytes / dev.memory_bytes < h100.memory_bytes / DEVICES["h100"].memory_bytes
