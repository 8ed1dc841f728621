"""Memory per rank (projection/footprint.py): it falls with sharding and checkpointing,
not with world size under no_shard."""

from __future__ import annotations

from fullshard.projection import DEVICES, SHAPES, Cluster, Settings, memory_per_rank


def test_memory_per_rank_falls_with_sharding_and_checkpointing():
    shape = SHAPES["llama3-8b"]
    dev = DEVICES["h100"]
    full = [memory_per_rank(shape, Cluster(dev, w, 8), Settings("full_shard", 1, 4096))
            for w in (8, 64, 512)]
    assert full[0] > full[1] > full[2]
    ns = {memory_per_rank(shape, Cluster(dev, w, 8), Settings("no_shard", 1, 4096))
          for w in (8, 64)}
    assert len(ns) == 1
    assert memory_per_rank(shape, Cluster(dev, 64, 8), Settings("full_shard", 1, 4096, 1,
                                                                "full")) < full[1]
