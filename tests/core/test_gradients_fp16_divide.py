"""fp16 gradients are divided before and after the sum, so a large world's sum stays in
range (Note [dividing fp16 gradients before and after the sum])."""

import pytest
import torch
import torch.distributed as dist

from fullshard import MixedPrecisionPolicy, fully_shard
from fullshard.core.gradients import divide_factors
from fullshard.testing import run_distributed


@pytest.mark.parametrize("dtype,factor,expected", [
    (torch.float32, 1024, (1.0, 1024)),
    (torch.bfloat16, 1024, (1.0, 1024)),
    (torch.float16, 2, (2.0, 1.0)),
    (torch.float16, 8, (4.0, 2.0)),
    (torch.float16, 1024, (32.0, 32.0)),
    (torch.float16, 6, (4.0, 1.5)),  # not a power of two: the rest after the sum
])
def test_the_division_is_split_only_where_the_sum_can_overflow(dtype, factor, expected):
    assert divide_factors(dtype, None, factor) == expected
    before, after = divide_factors(dtype, 3.0 * factor, factor)  # set_gradient_divide_factor
    assert before * after == 3.0 * factor


class _TwoBranches(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.used = torch.nn.Linear(4, 4, bias=False)
        self.unused = torch.nn.Linear(4, 4, bias=False)  # no rank uses it: .grad stays None

    def forward(self, x):
        return self.used(x)


def _fp16_gradients_near_the_top_of_the_range():
    torch.manual_seed(0)
    model = _TwoBranches()
    with torch.no_grad():
        model.used.weight.fill_(1.0)
    fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float16,
                                                      reduce_dtype=torch.float16))
    x = torch.ones(1, 4)
    # each rank's gradient is 40,000 (fp16 holds up to 65,504): their sum is not
    (model(x).float().sum() * 40000.0).backward()
    return model.used.weight.grad.full_tensor(), model.unused.weight.grad


def test_fp16_gradients_whose_sum_overflows_fp16_average_exactly():
    for grad, unused in run_distributed(_fp16_gradients_near_the_top_of_the_range, 2):
        assert torch.equal(grad, torch.full((4, 4), 40000.0)), grad
        assert unused is None  # the presence flags arrived exact: nobody had a gradient
