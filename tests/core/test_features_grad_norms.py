"""core/features/grad_norms.py: norms measured on the device as offloaded gradients are reduced
are used only for the very gradients measured, unchanged since (Note [gradient norms
measured before the copy to the host])."""

import torch

from fullshard.core.features import grad_norms


class _Grad:
    """What the measured norms read of a sharded ``.grad``: its local tensor."""

    _version = 0  # the DTensor wrapper's counter; these tests write the local tensor

    def __init__(self, values):
        self._local_tensor = torch.as_tensor(values, dtype=torch.float32)


def _host_pass(grads):
    norms = torch.stack(torch._foreach_norm([g._local_tensor for g in grads], 2,
                                            dtype=torch.float32))
    return norms.pow(2.0).sum()


def test_the_measured_sum_is_the_host_pass_bit_for_bit_in_the_order_asked():
    torch.manual_seed(0)
    unit_a = [_Grad(torch.randn(5)), _Grad(torch.randn(3, 2))]
    unit_b = [_Grad(torch.randn(7)), _Grad(torch.zeros(0))]
    for unit in (unit_a, unit_b):
        grad_norms.record(unit, grad_norms.measure([g._local_tensor for g in unit]))
    asked = [unit_b[0], unit_a[1], unit_b[1], unit_a[0]]
    measured = grad_norms.squared_sum(asked)
    assert torch.equal(measured, _host_pass([g for g in asked if g._local_tensor.numel()]))


def test_a_gradient_written_since_or_never_measured_is_not_covered():
    unit = [_Grad([3.0, 4.0]), _Grad([1.0])]
    grad_norms.record(unit, grad_norms.measure([g._local_tensor for g in unit]))
    assert grad_norms.squared_sum(unit).item() == 26.0
    unit[1]._local_tensor.mul_(2)  # a hook, an accumulation, a clip: the version moves
    assert grad_norms.squared_sum(unit) is None
    assert grad_norms.squared_sum([unit[0]]).item() == 25.0
    assert grad_norms.squared_sum([unit[0], _Grad([1.0])]) is None
    grad_norms.forget([unit[0]])
    assert grad_norms.squared_sum([unit[0]]) is None
