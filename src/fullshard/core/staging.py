"""Where a group's collective staging buffers come from when not from the pool.

Note [staging buffers from the process group]
The all-gather's output and the reduce-scatter's input are staging buffers: made for one
collective and dropped after it. They come from the root's pool (Note [which buffers are
pooled]) unless the unit asked otherwise, as torch's FSDP2 lets it:

* ``set_allocate_memory_from_process_group_for_comm(True)``: both come from the process
  group's own allocator where its backend offers one (``supports_tensor_alloc(device)``,
  then ``allocate_tensor``; NCCL registers such memory for zero-copy transfers over
  NVLink SHARP / InfiniBand). Where the backend offers none (gloo, any CPU tensor) they
  come from the pool as without the setting, as torch's FSDP2 then allocates as usual.
* ``set_symm_mem_for_comm("NCCL")``: the all-gather's output comes from symmetric memory
  (``torch.distributed._symmetric_memory``'s pool for the device) and is registered with
  the group before the collective, so NCCL can use its copy-engine or symmetric-kernel
  all-gather. The setter chooses the backend and makes the communicator exist at once (a
  barrier on the shard group), as torch does; where symmetric memory cannot work (a torch
  without it, CPU devices) the setter raises, as torch's does.

Such a buffer belongs to its allocator: it never enters the pool, and it lives until the
collective that uses it has been waited for (the reduction holds it like a custom
collective's, Note [custom collectives]). A custom collective's own ``allocate`` wins over
both, and torch refuses these setters beside one (fsdp_module.py). The CUDA paths follow
torch's documented semantics and are not yet run on a GPU by fullshard's tests.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .comm import BufferPool


class Staging:
    """Where staging buffers come from: a subclass's ``offers(pg, device)`` and
    ``allocate(pg, numel, dtype, device)``. A group with neither setting takes them from
    the pool itself, so its steps never enter this file."""

    def take(self, pool: BufferPool, pg: dist.ProcessGroup, numel: int, dtype: torch.dtype,
             device: torch.device) -> tuple[torch.Tensor, bool]:
        """A buffer of ``numel`` elements from here where this offers one for ``device``,
        else from ``pool``; and whether it is the pool's (to be given back)."""
        if self.offers(pg, device):
            return self.allocate(pg, numel, dtype, device), False
        return pool.take(numel, dtype, device), True


class ProcessGroupStaging(Staging):
    """Staging buffers from the process group's backend's allocator, where it has one."""

    setter = "set_allocate_memory_from_process_group_for_comm"
    torch_names = {"all gather": "ProcessGroupAllocAllGather",
                   "reduce scatter": "ProcessGroupAllocReduceScatter"}

    def backend(self, pg: dist.ProcessGroup, device: torch.device):
        return pg._get_backend(device)

    def offers(self, pg: dist.ProcessGroup, device: torch.device) -> bool:
        """Whether ``pg``'s backend for ``device`` allocates tensors itself."""
        backend = self.backend(pg, device)
        supports = getattr(backend, "supports_tensor_alloc", None)
        return supports is not None and bool(supports(device))

    def allocate(self, pg: dist.ProcessGroup, numel: int, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
        return self.backend(pg, device).allocate_tensor(numel, dtype=dtype, device=device)


# stateless: one for every group, so groups with the setting still merge into buckets
PROCESS_GROUP_STAGING = ProcessGroupStaging()


class SymmetricStaging(Staging):
    """All-gather outputs in symmetric memory (``set_symm_mem_for_comm``)."""

    setter = "set_symm_mem_for_comm"
    torch_names = {"all gather": "SymmMemAllGather"}

    def __init__(self, pg: dist.ProcessGroup, backend: str, device: torch.device):
        # imported here: the module initializes CUDA-only machinery torch builds without
        # CUDA load lazily, and only this setter needs it
        import torch.distributed._symmetric_memory as symm_mem
        self._symm_mem = symm_mem
        symm_mem.set_backend(backend)  # raises where torch has no such backend
        if device.type != "cuda":
            raise RuntimeError(f"symmetric memory needs CUDA devices; the unit computes on "
                               f"{device.type}")
        # the communicator must exist before the first rendezvous (torch does the same)
        dist.barrier(group=pg)

    def offers(self, pg: dist.ProcessGroup, device: torch.device) -> bool:
        return True

    def allocate(self, pg: dist.ProcessGroup, numel: int, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
        # the pool reuses the symmetric segments, so no allocation or rendezvous per step
        with torch.cuda.use_mem_pool(self._symm_mem.get_mem_pool(device)):
            out = torch.empty(numel, dtype=dtype, device=device)
        self._symm_mem.rendezvous(out, group=pg.group_name)
        return out
