"""core/containers: the tensors inside dataclasses are found and replaced like those
inside lists and dicts (Note [dataclasses between units])."""

import dataclasses

import torch

from fullshard.core.containers import flatten, unflatten


@dataclasses.dataclass(frozen=True)
class _Frozen:
    x: torch.Tensor
    label: str
    derived: int = dataclasses.field(init=False, default=7)


@dataclasses.dataclass
class _Outer:
    inner: _Frozen
    rest: list


def test_leaves_of_nested_dataclasses_are_found_and_replaced():
    a, b, c = torch.zeros(1), torch.ones(1), torch.full((1,), 2.0)
    tree = ({"out": _Outer(_Frozen(a, "a"), [b, 3])}, c)
    leaves, spec = flatten(tree)
    assert [type(x) for x in leaves] == [torch.Tensor, str, int, torch.Tensor, int, torch.Tensor]
    doubled = unflatten([x * 2 if isinstance(x, torch.Tensor) else x for x in leaves], spec)
    record = doubled[0]["out"]
    assert isinstance(record, _Outer) and isinstance(record.inner, _Frozen)
    assert torch.equal(record.inner.x, a * 2) and record.inner.label == "a"
    assert record.inner.derived == 7 and torch.equal(record.rest[0], b * 2)
    assert torch.equal(doubled[1], c * 2)
    assert tree[0]["out"].inner.x is a  # the caller's records are left as they were


def test_a_record_whose_values_are_unchanged_comes_back_as_it_was():
    record = _Outer(_Frozen(torch.zeros(1), "a"), [])
    leaves, spec = flatten([record])
    assert unflatten(leaves, spec)[0] is record
    t = torch.ones(2)
    leaves, spec = flatten(t)
    assert leaves[0] is t and unflatten(leaves, spec) is t
