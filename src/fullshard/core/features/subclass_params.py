"""Parameters whose tensor subclass takes part in the all-gather (quantized weights).

Note [tensor-subclass parameters]
torch's FSDP2 lets a tensor subclass choose what its shard sends: a subclass that
defines ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather`` (torchao's NF4Tensor, its
float8 training weights, any user subclass) is asked, at every gather, for one or more
all-gather inputs of any dtypes plus metadata, and after the gather rebuilds the
unsharded parameter from the gathered outputs. fullshard follows torch 2.13's protocol:
* Sharding is done by the subclass's own ops, in torch's order: ``torch.chunk`` on
  dim 0 (empty chunks for trailing ranks), ``new_zeros`` of the padded chunk size,
  ``narrow(...).copy_`` of this rank's chunk, ``narrow`` back to its real rows. That
  narrowed subclass tensor is the sharded DTensor's local tensor.
* ``fsdp_pre_all_gather`` is called on the DTensor's *current* local tensor (so an
  optimizer step or a load is what the next gather sends) with ``(mesh, outer_size,
  outer_stride, module, mp_policy)``, or with ``(mesh)`` alone for subclasses that
  declare the one-argument form (torchao's NF4 and float8). ``module`` is the module
  the parameter is registered on. On a rank whose shard is short of the padded size,
  every input must have the padded size (torch's rule: the subclass pads).
* The inputs of a unit's subclass parameters go out in one all-gather: as their common
  dtype, or as bytes (uint8) when they differ or are float8 (gloo has no float8). Each input's gathered rows are copied
  into a persistent output tensor of its own (``world * numel``), through an alias
  with its own version counter (Note [unsharded params are persistent views]).
* ``fsdp_post_all_gather(outputs, metadata, param_dtype)`` builds the unsharded
  tensor at the first gather, and returns the inner tensors to free at reshard; the
  unsharded parameter is that tensor viewed at the original size (``as_strided``) and
  keeps its identity. Later gathers re-allocate the outputs' and inner tensors'
  storage and call ``fsdp_post_all_gather(..., out=unsharded)``.
* Reshard resizes the outputs' and inner tensors' storage to zero.
These parameters stay out of the unit's flat buffers (core/group.py): the plain ones
are gathered as before, beside them, and trainable subclass parameters (float8
weights) reduce their plain gradients with the plain ones, since gradients have the
parameter's padded dim-0 layout. A unit holding them is gathered alone (never in a
batch of small units) and is refused with ``reshard_after_forward=N``, a 2-D mesh and tensor
parallelism, which this path does not implement. Under CPU offload a subclass shard
lives on the host beside the flat shard (not pinned: a subclass need not support
pinning, so its copy to the device is synchronous); its all-gather inputs are copied to
the compute device before the gather, and its gradients (float8 weights) land on the
host with the plain ones. A custom all-gather
(``set_custom_all_gather``) moves the unit's plain parameters only; the subclass inputs
take the built-in all-gather. Its send and receive buffers come from the root's pool
(Note [which buffers are pooled]) and go back once copied out.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ..comm import BufferPool, Pending, all_gather


def is_tensor_subclass(t: torch.Tensor) -> bool:
    """A tensor of a subclass other than torch's parameter and DTensor types."""
    cls = type(t)
    return cls is not torch.Tensor and not issubclass(cls, (nn.Parameter, DTensor))


def has_all_gather_hooks(t: torch.Tensor) -> bool:
    return hasattr(t, "fsdp_pre_all_gather") and hasattr(t, "fsdp_post_all_gather")


def check_subclass_param(label: str, fqn: str, p: torch.Tensor) -> None:
    """A tensor-subclass parameter must define both all-gather hooks: gathering its
    values as a plain tensor would silently drop the subclass."""
    if is_tensor_subclass(p) and not has_all_gather_hooks(p):
        raise TypeError(
            f"fully_shard({label}): parameter '{fqn}' is a {type(p).__name__}, a tensor "
            "subclass without fsdp_pre_all_gather/fsdp_post_all_gather; fullshard cannot "
            "shard it without dropping the subclass. Define both methods on the subclass, "
            "or pass the parameter in ignored_params.")


def check_subclass_unit(label: str, fqn: str, *, post_forward: bool,
                        tensor_parallel: bool, mesh_ndim: int,
                        how: str = "gathers through its tensor subclass (fsdp_pre_all_gather)"
                        ) -> None:
    """The features the side gather does not implement (Note [tensor-subclass
    parameters]); ``how`` says why the parameter takes it."""
    what = ("reshard_after_forward=N" if post_forward
            else "tensor parallelism" if tensor_parallel
            else "a 2-D (hybrid sharding) mesh" if mesh_ndim != 1 else None)
    if what is not None:
        raise NotImplementedError(
            f"fully_shard({label}): parameter '{fqn}' {how}, which fullshard does not "
            f"combine with {what}; shard this unit without it.")


class SubclassShard:
    """One subclass parameter's side of the protocol: its shard, the metadata of the
    gather in flight, the persistent gathered outputs and the unsharded tensor."""

    def __init__(self, fqn: str, module: nn.Module, full: torch.Tensor):
        self.fqn = fqn
        self.module = module
        self.outer_size = full.size()
        self.outer_stride = _contiguous_strides(full.size())
        self.padded_size: torch.Size | None = None
        self.uneven = False  # some rank's shard is short of the padded size
        self.metadata: Any = None
        self.input_sizes: list[torch.Size] = []
        self.outputs: list[torch.Tensor] = []
        self.inner: list[torch.Tensor] = []
        self.unsharded: nn.Parameter | None = None

    def shard(self, label: str, full: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
        """This rank's shard, made by the subclass's own ops as torch makes it. Every
        rank checks every rank's split, so a subclass that cannot make one raises on all
        ranks alike instead of leaving the others waiting in a collective."""
        try:
            with torch.no_grad():
                chunks = list(torch.chunk(full.detach(), world_size, dim=0))
                wanted = [c.shape for c in torch.chunk(torch.empty(full.shape, device="meta"),
                                                       world_size, dim=0)]
                if [c.shape for c in chunks] != wanted:
                    raise ValueError(f"torch.chunk gave shapes {[tuple(c) for c in chunks]}")
                self.padded_size = chunks[0].size()
                self.uneven = self.padded_size[0] * world_size != full.size(0)
                padded = full.new_zeros(self.padded_size)
                lengths = {c.size(0) for c in chunks} | ({0} if len(chunks) < world_size else set())
                for length in sorted(lengths):
                    padded.narrow(0, 0, length)
                rows = chunks[rank].size(0) if rank < len(chunks) else 0
                if rows:
                    padded.narrow(0, 0, rows).copy_(chunks[rank])
                return padded.narrow(0, 0, rows)
        except (NotImplementedError, AssertionError, RuntimeError, ValueError) as err:
            raise ValueError(
                f"fully_shard({label}): parameter '{self.fqn}' ({type(full).__name__}, shape "
                f"{tuple(full.shape)}) cannot be split into {world_size} dim-0 shards by its "
                f"subclass ({type(err).__name__}: {_first_line(err)}). Choose a shape whose "
                "rows divide evenly over the ranks in whole quantization blocks, or pass it "
                "in ignored_params.") from None

    def gather_inputs(self, local: torch.Tensor, mesh, mp_policy) -> list[torch.Tensor]:
        """Ask the subclass for its all-gather inputs (1-D), keeping the metadata."""
        hook = local.fsdp_pre_all_gather
        nargs = len(inspect.signature(hook).parameters)
        if nargs == 1:
            inputs, self.metadata = hook(mesh)
        elif nargs == 5:
            inputs, self.metadata = hook(mesh, self.outer_size, self.outer_stride,
                                         self.module, mp_policy)
            # torch checks this on the short ranks only; checked on every rank of an
            # unevenly sharded parameter, the error cannot leave the others in the gather
            if self.uneven and any(t.size() != self.padded_size for t in inputs):
                raise ValueError(
                    f"fullshard: parameter '{self.fqn}' (shape {tuple(self.outer_size)}) is "
                    f"sharded unevenly, so {type(local).__name__}.fsdp_pre_all_gather must "
                    f"return inputs of the padded shard size {tuple(self.padded_size)} on "
                    f"every rank; it returned {[tuple(t.shape) for t in inputs]}. Pad them "
                    "in fsdp_pre_all_gather, or give the parameter rows that divide evenly.")
        else:
            raise TypeError(
                f"fullshard: parameter '{self.fqn}': {type(local).__name__}."
                f"fsdp_pre_all_gather{inspect.signature(hook)} takes {nargs} arguments; "
                "torch's protocol is (mesh, outer_size, outer_stride, module, mp_policy) "
                "or (mesh).")
        self.input_sizes = [t.size() for t in inputs]
        return [t.contiguous().view(-1) for t in inputs]

    def alloc_outputs(self, inputs: list[torch.Tensor], world_size: int) -> list[torch.Tensor]:
        """The persistent outputs, created once and re-allocated for every gather."""
        if not self.outputs:
            self.outputs = [torch.empty(world_size * t.numel(), dtype=t.dtype, device=t.device)
                            for t in inputs]
        for t in self.outputs:
            _alloc_storage(t)
        return self.outputs

    def rebuild(self, local: torch.Tensor, param_dtype: torch.dtype | None,
                requires_grad: bool) -> nn.Parameter:
        """Run ``fsdp_post_all_gather`` over the outputs; the unsharded parameter."""
        outputs = tuple(t.view(-1, *s[1:]) for t, s in zip(self.outputs, self.input_sizes))
        dtype = param_dtype or local.dtype
        if self.unsharded is not None:
            for t in self.inner:
                _alloc_storage(t)
            local.fsdp_post_all_gather(outputs, self.metadata, dtype, out=self.unsharded)
        else:
            tensor, inner = local.fsdp_post_all_gather(outputs, self.metadata, dtype)
            self.inner = list(inner)
            value = torch.as_strided(tensor, self.outer_size, self.outer_stride, storage_offset=0)
            self.unsharded = nn.Parameter(value, requires_grad=requires_grad)
        self.metadata = None
        return self.unsharded

    def free(self) -> None:
        for t in self.outputs + self.inner:
            storage = t.untyped_storage()
            if storage.size():
                storage.resize_(0)

    def gathered_bytes(self) -> int:
        """Bytes the gathered outputs hold now (zero while sharded)."""
        return sum(t.untyped_storage().nbytes() for t in self.outputs)


class KeptDtypeShard(SubclassShard):
    """A plain parameter that ``param_dtype_override_fn`` keeps in its own dtype while
    the rest of its unit computes in ``param_dtype``: it gathers beside the unit's flat
    buffer, in that dtype, through this side path (no hooks of its own: its padded
    shard goes out as it is and the unsharded parameter views the gathered rows)."""

    def __init__(self, fqn: str, module: nn.Module, full: torch.Tensor):
        super().__init__(fqn, module, full)
        self._padded: torch.Tensor | None = None

    def gather_inputs(self, local: torch.Tensor, mesh, mp_policy) -> list[torch.Tensor]:
        if local.size(0) == self.padded_size[0]:
            padded = local
        else:  # a short shard goes out padded, as every rank's must have one size
            if self._padded is None or self._padded.device != local.device:
                self._padded = local.new_zeros(self.padded_size)
            self._padded.narrow(0, 0, local.size(0)).copy_(local)
            padded = self._padded
        self.input_sizes = [padded.size()]
        return [padded.contiguous().view(-1)]

    def rebuild(self, local: torch.Tensor, param_dtype: torch.dtype | None,
                requires_grad: bool) -> nn.Parameter:
        if self.unsharded is None:
            rows = self.outputs[0].view(-1, *self.input_sizes[0][1:])
            value = rows.narrow(0, 0, self.outer_size[0]).view(self.outer_size)
            self.unsharded = nn.Parameter(value, requires_grad=requires_grad)
        return self.unsharded


def subclass_bytes(t: torch.Tensor) -> int:
    """The bytes a tensor subclass really holds: the sum of its inner tensors."""
    if not hasattr(t, "__tensor_flatten__"):
        return t.numel() * t.element_size()
    return sum(subclass_bytes(getattr(t, name)) for name in t.__tensor_flatten__()[0])


class SubclassGather:
    """The one all-gather of a unit's subclass parameters and its copy-out."""

    def __init__(self, params: list, pg, mesh, unit_name: str):
        self.params = params  # ShardedParams with an ``extension`` (SubclassShard)
        self.pg = pg
        self.mesh = mesh
        self.unit_name = unit_name
        self._pending: Pending | None = None
        self._inputs: list[list[torch.Tensor]] = []
        self._pool: BufferPool | None = None
        self._send: torch.Tensor | None = None

    def start(self, mp_policy, pool: BufferPool, async_op: bool, device: torch.device) -> None:
        """Collect every parameter's inputs, on ``device`` (the compute device: a shard
        offloaded to the host sends from there), and issue the all-gather."""
        self._inputs = [[t if t.device == device else t.to(device, non_blocking=True)
                         for t in p.extension.gather_inputs(p.sharded_param._local_tensor,
                                                            self.mesh, mp_policy)]
                        for p in self.params]
        for p, inputs in zip(self.params, self._inputs):
            _check_float8_runs(p.fqn, inputs)
        flat = [t for ts in self._inputs for t in ts]
        dtypes = {t.dtype for t in flat}
        # Different dtypes go out as bytes (torch does the same); so do float8 inputs, which
        # gloo cannot send: the bytes on the wire are the same.
        as_bytes = len(dtypes) > 1 or any(_is_float8(d) for d in dtypes)
        flat = [t.view(torch.uint8) if as_bytes else t for t in flat]
        numel, dtype, device = sum(t.numel() for t in flat), flat[0].dtype, flat[0].device
        self._pool = pool
        self._send = pool.take(numel, dtype, device)
        torch.cat(flat, out=self._send)
        out = pool.take(self.pg.size() * numel, dtype, device)
        self._pending = all_gather(out, self._send, self.pg, async_op=async_op,
                                   what=f"all-gather of {self.unit_name} (tensor-subclass "
                                        "parameters)")

    def finish(self, param_dtype: torch.dtype | None) -> None:
        """Copy the gathered rows into each input's output and rebuild the parameters."""
        w = self.pg.size()
        gathered = self._pending.wait(f"all-gather of {self.unit_name}").view(w, -1)
        self._pending = None
        targets = []
        for p, inputs in zip(self.params, self._inputs):
            for out in p.extension.alloc_outputs(inputs, w):
                # own version counter: Note [unsharded params are persistent views]
                view = out.data.view(w, -1)
                targets.append(view.view(torch.uint8) if gathered.dtype == torch.uint8 else view)
        torch.split_with_sizes_copy(gathered, [t.size(1) for t in targets], dim=1, out=targets)
        self._give_back(gathered)
        for p in self.params:
            p.unsharded_param = p.extension.rebuild(p.sharded_param._local_tensor, param_dtype,
                                                    p.sharded_param.requires_grad)
        self._inputs = []

    def drop(self) -> None:
        """Reshard while gathering: wait for the collective, keep nothing."""
        if self._pending is not None:
            self._give_back(self._pending.wait(f"all-gather of {self.unit_name}"))
            self._pending = None
        self._inputs = []
        self.free()

    def _give_back(self, gathered: torch.Tensor) -> None:
        self._pool.give(gathered.view(-1))
        self._pool.give(self._send)
        self._send = None

    def free(self) -> None:
        for p in self.params:
            p.extension.free()

    def sharded_bytes(self) -> int:
        return sum(subclass_bytes(p.sharded_param._local_tensor) for p in self.params)

    def unsharded_bytes(self) -> int:
        return sum(p.extension.gathered_bytes() for p in self.params)


def _is_float8(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point and dtype.itemsize == 1


# device -> whether a float8 matmul runs there. Process-wide because the answer is a
# property of the installed torch and the hardware; probing allocates on the device.
_FLOAT8_RUNS: dict[torch.device, bool] = {}


def float8_matmul_runs(device: torch.device) -> bool:
    """Whether ``torch._scaled_mm``, the matmul float8 weights are used in, runs on
    ``device`` (probed once)."""
    if device not in _FLOAT8_RUNS:
        try:
            a = torch.zeros(16, 16, device=device).to(torch.float8_e4m3fn)
            one = torch.ones((), device=device)
            torch._scaled_mm(a, a.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
            _FLOAT8_RUNS[device] = True
        except (RuntimeError, NotImplementedError):
            _FLOAT8_RUNS[device] = False
    return _FLOAT8_RUNS[device]


def _check_float8_runs(fqn: str, inputs: list[torch.Tensor]) -> None:
    for t in inputs:
        if _is_float8(t.dtype) and not float8_matmul_runs(t.device):
            raise RuntimeError(
                f"fullshard: parameter '{fqn}' gathers as {t.dtype}, but float8 matmuls do "
                f"not run on {t.device} (torch._scaled_mm fails there: float8 needs a CUDA "
                "GPU of compute capability 8.9 or newer, or a CPU build of torch that has "
                "it). Train this model without float8 (drop convert_to_float8_training) on "
                "this device.")


def _alloc_storage(t: torch.Tensor) -> None:
    nbytes = t.numel() * t.element_size()
    storage = t.untyped_storage()
    if storage.size() != nbytes:
        storage.resize_(nbytes)


def _contiguous_strides(size: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(size):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__
