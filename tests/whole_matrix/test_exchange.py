"""The values a whole-matrix optimizer's owners hand back through an object collective
(Note [whole-matrix optimizers], "Between steps"): tensors on a device travel through the
host, so that no rank unpickles a tensor onto another rank's GPU."""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.distributed as dist

from fullshard.whole_matrix import kept as kept_module
from fullshard.whole_matrix.exchange import Item, OnDevice


class _OnAnotherGpu(torch.Tensor):
    """A host tensor that says it lives on cuda:1: the CPU lane's stand-in for a state
    tensor (Adafactor's row_var) on the owner's GPU. Moving it anywhere gives a plain
    tensor, as moving a CUDA tensor to the host does."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @property
    def device(self):
        return torch.device("cuda", 1)

    def to(self, *args, **kwargs):
        return self.as_subclass(torch.Tensor).to(*args, **kwargs)

    def cpu(self):
        return self.as_subclass(torch.Tensor)


class _Pair:
    """Rank 0 of a shard group of two (only its rank and size are asked)."""

    def rank(self):
        return 0

    def size(self):
        return 2


def _tensors(obj) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, (list, tuple)):
        return [t for x in obj for t in _tensors(x)]
    return []


def test_state_tensors_on_a_device_cross_the_object_collective_on_the_host(monkeypatch):
    pg = _Pair()
    ours, theirs = torch.zeros(4, 6), torch.zeros(4, 6)
    items = [Item(ours, SimpleNamespace(fqn="a"), pg, 0),
             Item(theirs, SimpleNamespace(fqn="b"), pg, 1)]
    kept = kept_module.Kept(items, ())
    row_var = torch.arange(4.0).as_subclass(_OnAnotherGpu)
    kept.states[id(ours)] = {"row_var": row_var, "step": torch.tensor(3.0)}
    sent = []

    def all_gather_object(everyone, mine, group=None):
        sent.append(mine)
        # what rank 1, the owner of "b", sends: its state tensors made ready the same way
        everyone[:] = [mine, [None, ((), {"col_var": OnDevice(torch.ones(6)),
                                          "step": torch.tensor(5.0)})]]

    monkeypatch.setattr(dist, "all_gather_object", all_gather_object)
    described = kept_module._described_by_owners(None, kept, items, torch.device("meta"))
    assert sent, "the owners' values go through all_gather_object"
    assert all(t.device.type == "cpu" and type(t) is torch.Tensor for t in _tensors(sent[0]))
    assert sent[0][0][1]["row_var"].host.tolist() == [0.0, 1.0, 2.0, 3.0]
    assert described[0][1]["row_var"] is row_var  # the owner keeps its own objects
    theirs_scalars = described[1][1]
    assert theirs_scalars["col_var"].device.type == "meta"  # lands on this rank's device
    assert theirs_scalars["step"].device.type == "cpu"      # a host tensor stays there
