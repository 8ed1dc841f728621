"""The layout of a rank's chunk of a gradient reduction (Note [a reduction's chunk])."""

import torch

from fullshard.core.gradients import chunk_gradients, chunk_numel, received_digests, split_chunk
from fullshard.core.guard.ledger import DIGEST_NUMEL, digest_elements


def test_a_chunk_is_the_shards_then_a_flag_each_then_the_digest():
    shards = [3, 5]
    assert chunk_numel(shards) == 8 + 2 + DIGEST_NUMEL
    chunk = torch.arange(float(chunk_numel(shards)))
    a, b, flags, digest = split_chunk(chunk, shards)
    assert a.tolist() == [0, 1, 2] and b.tolist() == [3, 4, 5, 6, 7]
    assert flags.tolist() == [8, 9] and digest.numel() == DIGEST_NUMEL
    assert a.data_ptr() == chunk.data_ptr()  # views: packing writes into the send buffer
    assert chunk_gradients(chunk, len(shards)).tolist() == list(range(8))


def test_the_digest_travels_exactly_in_low_precision_floats():
    digest = 0xFEDCBA9876543210
    elements = digest_elements(digest)
    assert len(elements) == DIGEST_NUMEL and max(elements) < 256
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        sent = torch.tensor(elements, dtype=dtype)
        back = sum(int(v) << (8 * i) for i, v in enumerate(sent.tolist()))
        assert back == digest, dtype


def test_every_senders_digest_is_read_from_the_copies_received():
    shards = [4]
    chunk = chunk_numel(shards)
    rows = torch.zeros(3, chunk + 2)  # received copies may be longer than a chunk
    for sender in range(3):
        rows[sender, chunk - DIGEST_NUMEL:chunk] = torch.tensor(
            digest_elements(100 + sender), dtype=rows.dtype)
    got = received_digests(rows, chunk)
    assert [int(r[0]) for r in got] == [100, 101, 102]
