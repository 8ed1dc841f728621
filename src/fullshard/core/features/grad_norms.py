"""Gradient norms measured where offloaded gradients are reduced, before the host copy.

Note [gradient norms measured before the copy to the host]
Under CPU offload a clip would otherwise read every host gradient once just to measure
it: on the GPU box that pass over the fp32 host gradients cost more than the CPU step
itself. The reduced shard is still on the device when ``PendingReduce`` finishes it, so
each parameter's local norm is measured there (``torch._foreach_norm``, float32, one
kernel per unit, no host sync) and kept beside the ``.grad`` it became, with the version
counters of that gradient and of its local tensor (a DTensor's in-place op bumps the
wrapper's counter only, a write to the local tensor only the local one). ``clip_grad_norm_`` (grad_norm.py) uses the
measured norms only when, for every gradient it is asked about, the ``.grad`` object is
the one measured and its version is unchanged: any in-place write since (a hook, an
accumulation into an existing ``.grad``, ``p.grad.mul_(2)``, a previous clip) bumps the
version, and a replaced ``.grad`` is another object, so the norm is never stale; then it
reads the host gradients as before. Only the 2-norm is measured. Writes that escape
autograd's version counter (``p.grad.data.mul_``) are not seen, as autograd does not see
them either. The measured norms are indexed in the order the clip asks for them and
summed as the clip's own foreach pass would sum them, so on the CPU the norm is the same
bits; on a GPU the device's norm kernel may differ from the host's in the last bits.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch.utils.weak import WeakIdKeyDictionary


class _Measured(NamedTuple):
    norms: torch.Tensor  # float32 on the device: one norm per parameter of the unit
    index: int           # this gradient's entry in ``norms``
    versions: tuple      # its and its local tensor's version counters when measured


# the measured ``.grad`` objects; weak keys: a gradient dropped by zero_grad takes its
# entry with it
_MEASURED = WeakIdKeyDictionary()


def measure(shards: list[torch.Tensor]) -> torch.Tensor:
    """Each of ``shards``' 2-norm as one float32 vector beside them (no host sync)."""
    if not shards:
        return torch.zeros(0, dtype=torch.float32)
    return torch.stack(torch._foreach_norm(shards, 2, dtype=torch.float32))


def record(grads: list, norms: torch.Tensor) -> None:
    """Keep ``norms[i]`` as the measured norm of ``grads[i]`` (sharded DTensor grads,
    already holding their final values) (Note [gradient norms measured before the copy
    to the host])."""
    for i, grad in enumerate(grads):
        _MEASURED[grad] = _Measured(norms, i, _versions(grad))


def _versions(grad) -> tuple[int, int]:
    return grad._version, grad._local_tensor._version


def forget(grads: list) -> None:
    """Drop what was measured of ``grads`` (a reduction whose result was discarded)."""
    for grad in grads:
        if grad is not None:
            _MEASURED.pop(grad, None)


def squared_sum(grads: list) -> torch.Tensor | None:
    """The sum of the squared norms of ``grads``' local tensors (float32, on the device
    the norms were measured on), summed in the order a foreach pass over them would sum;
    None unless every one was measured and is unchanged since."""
    entries = []
    for grad in grads:
        entry = _MEASURED.get(grad)
        if entry is None or entry.versions != _versions(grad):
            return None
        if grad._local_tensor.numel() > 0:  # the clip's own pass skips empty shards
            entries.append(entry)
    if not entries:
        return None
    vectors: dict[int, int] = {}  # id(norms) -> its offset in the concatenation
    pieces: list[torch.Tensor] = []
    offset = 0
    for entry in entries:
        if id(entry.norms) not in vectors:
            vectors[id(entry.norms)] = offset
            offset += entry.norms.numel()
            pieces.append(entry.norms)
    where = pieces[0].device
    if len({v.device for v in pieces}) > 1:
        return None
    index = torch.tensor([vectors[id(e.norms)] + e.index for e in entries], device=where)
    return torch.cat(pieces).index_select(0, index).pow(2.0).sum()
