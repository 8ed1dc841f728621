"""estimate with offload="cpu:FRACTION": the offloaded blocks' shards, gradients and
optimizer states move from the device to the host. On a CPU-only machine the device and
the host are one memory, so a measured peak cannot tell them apart; these tests check
the byte accounting instead."""

import pytest

from fullshard.gpt import GPTConfig
from fullshard.memory.estimate import estimate_traced, offload_mode, trace_workload

CFG = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=4, n_heads=2)
STATES = ("sharded parameters", "gradients", "optimizer states")


@pytest.fixture(scope="module")
def step():
    return trace_workload(CFG, batch_size=2)


def _run(step, offload):
    return estimate_traced(step, world_size=2, offload=offload, process_baseline=0)


def test_device_bytes_fall_with_the_fraction_and_host_bytes_rise(step):
    runs = [_run(step, o) for o in ("none", "cpu:0.25", "cpu:0.5", "cpu:0.75", "cpu")]
    device = [sum(r.lines[c] for c in STATES) for r in runs]
    host = [r.host_bytes for r in runs]
    assert device == sorted(device, reverse=True) and len(set(device)) == 5
    assert host == sorted(host) and host[0] == 0


def _state_bytes(block, world=2):
    """AdamW's two fp32 states of ``block``'s dim-0 shards (padded rows) on one rank."""
    return sum(2 * 4 * -(-p.shape[0] // world) * (p.numel() // max(p.shape[0], 1))
               for p in block.parameters())


def test_the_device_keeps_the_unoffloaded_units_states(step):
    """cpu:0.5 of 4 blocks moves the last two blocks' optimizer states, and no more, to
    the host; the embeddings, head and root keep theirs on the device."""
    none, half = _run(step, "none"), _run(step, "cpu:0.5")
    moved = sum(_state_bytes(b) for b in step.model.layers[2:])
    assert none.lines["optimizer states"] - half.lines["optimizer states"] == moved
    assert half.host_bytes >= moved


def test_impossible_fractions_are_refused(step):
    for bad in ("cpu:0", "cpu:1.5", "cpu:x"):
        with pytest.raises(ValueError, match="cpu:"):
            _run(step, bad)


def test_a_fraction_keeps_its_digits():
    """cpu:0.6666666666666666 is 2 of 3 blocks; six significant digits (0.666667) would
    make it 3 of them, as ceil(0.666667 x 3) is."""
    step3 = trace_workload(GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=3,
                                     n_heads=2), batch_size=1)
    two = estimate_traced(step3, world_size=2, offload=f"cpu:{2 / 3!r}", process_baseline=0)
    moved = sum(_state_bytes(b) for b in step3.model.layers[1:])
    none = estimate_traced(step3, world_size=2, offload="none", process_baseline=0)
    assert none.lines["optimizer states"] - two.lines["optimizer states"] == moved
    assert offload_mode(f"cpu:{2 / 3!r}") == f"cpu:{2 / 3!r}"
    assert offload_mode("cpu:0.50") == "cpu:0.5" and offload_mode("cpu:1") == "cpu"
    assert f", offload cpu:{2 / 3!r}, " in two.table().splitlines()[0]


def test_states_of_a_fraction_on_disk_free_the_device_as_cpu_offload_does(step):
    """disk:0.5 (--parallel.offload disk:PATH:0.5) moves the last two blocks off the
    device as cpu:0.5 does; their optimizer states go to the files (and with +params
    their shards too), the device-resident blocks' states stay on the device."""
    half, disk, both = (_run(step, o) for o in ("cpu:0.5", "disk:0.5", "disk+params:0.5"))
    assert disk.lines == half.lines and both.lines == half.lines
    moved = sum(_state_bytes(b) for b in step.model.layers[2:])
    # each unit's states start on a 4,096-element boundary of the files (two fp32 states
    # here; the small blocks may share a bucket, and so a unit)
    pad = 2 * 4 * 4096
    assert moved <= disk.disk_bytes < moved + 2 * pad
    shards = sum(4 * -(-p.shape[0] // 2) * (p.numel() // max(p.shape[0], 1))
                 for b in step.model.layers[2:] for p in b.parameters())
    assert both.disk_bytes == disk.disk_bytes + shards
    assert disk.settings["offload"] == "disk:0.5"
    assert ", offload disk+params:0.5, " in both.table().splitlines()[0]
    whole = _run(step, "disk")
    assert whole.disk_bytes > disk.disk_bytes and whole.lines["optimizer states"] == 0


def test_the_host_holds_less_with_a_fraction_on_disk_than_in_memory():
    """Blocks large beside the three staging chunks (4M elements each): the host keeps
    the moved blocks' shards and gradients but not their states."""
    big = trace_workload(GPTConfig(vocab_size=256, seq_len=16, d_model=1024, n_layers=8,
                                   n_heads=4), batch_size=1)
    half, disk = (estimate_traced(big, world_size=2, offload=o, process_baseline=0)
                  for o in ("cpu:0.5", "disk:0.5"))
    assert disk.host_bytes < half.host_bytes
    assert disk.total == half.total
    quarter = estimate_traced(big, world_size=2, offload="disk:0.25", process_baseline=0)
    assert 0 < quarter.disk_bytes < disk.disk_bytes and quarter.total > disk.total


def test_impossible_disk_fractions_are_refused(step):
    for bad in ("disk:0", "disk:1.5", "disk+params:x", "disk:nan"):
        with pytest.raises(ValueError, match=bad.replace("+", r"\+")):
            _run(step, bad)
    assert offload_mode("disk:1") == "disk" and offload_mode("disk+params:0.50") == \
        "disk+params:0.5"
