"""Staging buffers not from the pool (core/staging.py): the process group's allocator
(``set_allocate_memory_from_process_group_for_comm``) and symmetric memory
(``set_symm_mem_for_comm``)."""

import torch

from fullshard.core import staging
from fullshard.testing import run_distributed
from support.small_gpt import same_steps, sgd_steps, sharded_gpt


class RecordingBackend:
    """A backend that allocates tensors itself (as NCCL does), noting each one."""

    def __init__(self):
        self.made = []

    def supports_tensor_alloc(self, device):
        return True

    def allocate_tensor(self, numel, *, dtype, device):
        t = torch.empty(numel, dtype=dtype, device=device)
        self.made.append(t)
        return t


def _units(model):
    return [model, *model.layers]


def _stand_in_worker():
    plain = sgd_steps(sharded_gpt(), 2)
    backend = RecordingBackend()
    staging.ProcessGroupStaging.backend = lambda self, pg, device: backend
    model = sharded_gpt()
    for unit in _units(model):
        unit.set_allocate_memory_from_process_group_for_comm(True)
    staged = sgd_steps(model, 2)
    pooled = {t.data_ptr() for t in model._unit.root.pool.idle()}
    shapes = sorted({t.numel() for t in backend.made})
    sizes = sorted({u._unit.group.world_size * u._unit.group.storage.numel
                    for u in _units(model)})
    return {
        # per step: four gathers (three layers and the root) and four reductions' inputs
        "made": len(backend.made),
        "same": same_steps(plain, staged),
        "none_pooled": not pooled & {t.data_ptr() for t in backend.made},
        "gather_sizes_included": set(sizes) <= set(shapes),
    }


def test_staging_buffers_come_from_the_backend_allocator_when_it_has_one():
    for result in run_distributed(_stand_in_worker, 2):
        # two steps; the root stays gathered from forward to backward: 4 + 3 gathers
        assert result == {"made": 2 * (4 + 3) + 2 * 4, "same": True, "none_pooled": True,
                          "gather_sizes_included": True}, result


def _gloo_worker():
    plain = sharded_gpt()
    plain_steps = sgd_steps(plain, 2)
    model = sharded_gpt()
    for unit in _units(model):
        unit.set_allocate_memory_from_process_group_for_comm(True)
    staged = sgd_steps(model, 2)
    return (model._unit.root.pool.allocations == plain._unit.root.pool.allocations,
            same_steps(plain_steps, staged))


def test_on_gloo_without_an_allocator_the_pool_serves_as_before():
    assert run_distributed(_gloo_worker, 2) == [(True, True)] * 2


def _off_again_worker():
    backend = RecordingBackend()
    staging.ProcessGroupStaging.backend = lambda self, pg, device: backend
    model = sharded_gpt()
    model.set_allocate_memory_from_process_group_for_comm(True)
    model.set_allocate_memory_from_process_group_for_comm(False)
    sgd_steps(model, 1)
    return len(backend.made)


def test_false_goes_back_to_the_pool():
    assert run_distributed(_off_again_worker, 2) == [0, 0]


def _symmetric_memory_worker():
    model = sharded_gpt()
    try:
        import torch.distributed._symmetric_memory as symm_mem
        symm_mem.set_backend("NCCL")
        torch_says = None
    except RuntimeError as err:
        torch_says = str(err)
    try:
        model.set_symm_mem_for_comm()
    except RuntimeError as err:
        ours = str(err)
    else:
        ours = None
    return torch_says, ours


def test_symmetric_memory_where_torch_cannot_have_it_raises_torchs_error_first():
    torch_says, ours = run_distributed(_symmetric_memory_worker, 2)[0]
    assert ours is not None and ours.startswith(torch_says or "symmetric memory needs CUDA")
    assert "fullshard: set_symm_mem_for_comm on GPT:" in ours
