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
