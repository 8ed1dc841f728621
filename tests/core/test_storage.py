"""A group's bytes (core/storage.py): the flat shard whose views are the parameters'
local tensors, and the gathered buffer freed while the unit is sharded, allocated for
each gather under the same parameter objects (at the same addresses when the storage is
kept)."""

import torch
import torch.distributed as dist
import torch.nn as nn

from fullshard import fully_shard
from fullshard.core.state import unit_of
from fullshard.testing import run_distributed


def _uneven_model():
    """Rows that 2 and 3 ranks do not divide: 5 rows, 3 rows, a bias of 7."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3), nn.Tanh(),
                         nn.Linear(3, 7))


def _flat_shard_worker():
    reference = _uneven_model()
    model = _uneven_model()
    fully_shard(model)
    storage = unit_of(model).group.storage
    world, rank = dist.get_world_size(), dist.get_rank()
    flat = storage.tensor
    assert flat.numel() == storage.numel == sum(storage.sizes)
    # each parameter's padded shard is the next stretch of the flat shard, its real rows
    # this rank's rows of the parameter, and its DTensor's local tensor those rows
    offset = 0
    for p, (name, full) in zip(storage.params, reference.named_parameters()):
        assert p.fqn == name
        rows = -(-full.shape[0] // world)
        assert p.layout.shard_numel == rows * full[0].numel()
        assert p.padded_shard.data_ptr() == flat.data_ptr() + offset * flat.element_size()
        torch.testing.assert_close(p.layout.valid(p.padded_shard),
                                   full.detach()[rank * rows:(rank + 1) * rows])
        local = p.sharded_param._local_tensor
        assert local.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
        offset += p.layout.shard_numel
    # the optimizer steps the flat shard in place: every local tensor moves with it
    with torch.no_grad():
        flat.add_(1.0)
    for p, full in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.full_tensor(), full.detach() + 1.0)
    return True


def test_the_flat_shard_is_every_parameters_local_tensor_in_order():
    assert run_distributed(_flat_shard_worker, 2) == [True] * 2
    assert run_distributed(_flat_shard_worker, 3) == [True] * 3


def _gathered_buffer_worker(keep_storage):
    model = _uneven_model()
    fully_shard(model, reshard_after_forward=True)
    model.set_keep_unsharded_storage(keep_storage)
    buffer = unit_of(model).group.unsharded
    seen = []
    for _ in range(2):
        model.unshard()
        seen.append((buffer.tensor.untyped_storage().size(),
                     [(id(p), p.data_ptr()) for p in model.parameters()]))
        model.reshard()
        seen.append((buffer.tensor.untyped_storage().size(), None))
    nbytes = buffer.tensor.numel() * buffer.tensor.element_size()
    return seen, nbytes, buffer.is_shard


def test_the_gathered_buffer_is_freed_while_sharded_and_refilled_under_the_same_views():
    seen, nbytes, is_shard = run_distributed(_gathered_buffer_worker, 2, False)[0]
    (gathered, pointers), (freed, _), (again, pointers_again), (freed_again, _) = seen
    assert not is_shard
    assert gathered == again == nbytes and freed == freed_again == 0
    # persistent views: each gather fills the same parameter objects
    assert [i for i, _ in pointers] == [i for i, _ in pointers_again]
    kept, nbytes, _ = run_distributed(_gathered_buffer_worker, 2, True)[0]
    # set_keep_unsharded_storage(True): never freed, so at the same addresses (CUDA graphs)
    assert [size for size, _ in kept] == [nbytes] * 4
    assert kept[0][1] == kept[2][1]


def test_at_one_rank_the_gathered_buffer_is_the_flat_shard():
    """Note [shard groups of one rank]: nothing to gather, free or copy."""
    seen, nbytes, is_shard = run_distributed(_gathered_buffer_worker, 1, False)[0]
    assert is_shard and [size for size, _ in seen] == [nbytes] * 4
