"""The trainer's data order (train/data.py): each epoch reads every window once, in a
seeded order that resumes exactly; too little data is named."""

import pytest
import torch

from fullshard.train.config.schema import ConfigError
from fullshard.train.data import EpochSampler, validation_batches


def _epoch_windows(tokens, world, batch, seq_len, seed, steps):
    samplers = [EpochSampler(tokens, seq_len, batch, r, world, seed) for r in range(world)]
    seen = []
    for _ in range(steps):
        for s in samplers:
            x, y = s.next_batch()
            assert torch.equal(x[:, 1:], y[:, :-1])
            seen += [tuple(row.tolist()) for row in x]
    return samplers, seen


def test_sampler_reads_no_window_twice_per_epoch_and_resumes_exactly():
    tokens = torch.arange(1000)  # every window is recognizable by its first id
    world, batch, seq_len = 3, 2, 10
    samplers, seen = _epoch_windows(tokens, world, batch, seq_len, seed=1, steps=20)
    per_epoch = (1000 - seq_len) // seq_len // (world * batch)  # 99 or more windows: 16
    first_epoch = seen[:per_epoch * world * batch]
    assert len(set(r[0] for r in first_epoch)) == len(first_epoch) == 96
    assert samplers[0].position.epoch == 1  # 20 steps crossed into the second epoch
    # Resuming from a saved position reads what the running samplers read next.
    restored = [EpochSampler(tokens, seq_len, batch, r, world, 1) for r in range(world)]
    for s, r in zip(samplers, restored):
        r.load_state_dict(s.state_dict())
        assert torch.equal(r.next_batch()[0], s.next_batch()[0])
    # Another seed, another order.
    assert _epoch_windows(tokens, world, batch, seq_len, seed=2, steps=1)[1] != seen[:6]


def test_sampler_and_validation_refuse_too_little_data():
    with pytest.raises(ConfigError, match="batch.batch_size"):
        EpochSampler(torch.arange(50), 10, 4, 0, 2, 0)
    with pytest.raises(ConfigError, match="batch.val_fraction"):
        validation_batches(torch.arange(30), 10, 4, 0, 2, 8)
    batches = [validation_batches(torch.arange(200), 10, 2, r, 2, 8) for r in range(2)]
    assert len(batches[0]) == len(batches[1]) == 4  # 19 windows: 4 batches of 2 x 2
    starts = {int(x[i, 0]) for b in batches for x, _ in b for i in range(2)}
    assert len(starts) == 16
