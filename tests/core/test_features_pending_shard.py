"""PendingShard: the copy of a flat shard that a delayed unit's gathers read (Note [the
delayed update])."""

import torch

from fullshard.core.features.pending_shard import PendingShard


class _Shard:
    """A flat shard as a ``ShardStorage`` offers it to ``PendingShard``."""

    def __init__(self, tensor):
        self.tensor = tensor
        self.numel, self.dtype, self.device = tensor.numel(), tensor.dtype, tensor.device
        self.pinned = False

    def copy_into(self, dst):
        dst.copy_(self.tensor)

    def offset_of(self, local):
        return local.storage_offset() - self.tensor.storage_offset()


def test_a_copy_is_taken_kept_apart_from_the_shard_and_counted_by_its_version():
    shard = torch.arange(10.0)
    pending = PendingShard()
    assert not pending.pending and pending.tensor is None
    pending.take(_Shard(shard))
    first, version = pending.tensor, pending.tensor._version
    shard.add_(100)  # the host step writes the shard: the copy keeps the values before
    assert pending.pending and torch.equal(pending.tensor, torch.arange(10.0))
    pending.take(_Shard(shard))  # the next step's copy: same buffer, a higher version
    assert pending.tensor is first and pending.tensor._version > version
    assert torch.equal(pending.tensor, torch.arange(10.0) + 100)
    pending.drop()
    assert not pending.pending


def test_a_parameter_view_maps_to_the_same_place_in_the_copy():
    shard = torch.arange(12.0)
    local = shard[4:10].view(2, 3)  # a parameter's local shard inside the flat shard
    pending = PendingShard()
    pending.take(_Shard(shard))
    shard.zero_()
    view = pending.view_of(local, _Shard(shard))
    assert view.shape == (2, 3) and torch.equal(view, torch.arange(4.0, 10.0).view(2, 3))


def test_a_shard_of_another_size_or_dtype_gets_a_new_buffer():
    pending = PendingShard()
    pending.take(_Shard(torch.ones(4)))
    pending.take(_Shard(torch.ones(6, dtype=torch.float64)))
    assert pending.tensor.shape == (6,) and pending.tensor.dtype == torch.float64
