"""A state dict checked against the sharded model before ``load_state_dict`` copies
anything (core/refusals/load_check.py): a missing key (under ``strict``), another shape, or a plain
tensor where the model shards is one error naming the key, and the model is untouched."""

import pytest
import torch
import torch.nn as nn

from fullshard import fully_shard
from fullshard.testing import run_distributed


def _model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))
    fully_shard(model[0])
    fully_shard(model)
    return model


def _refusals():
    model = _model()
    before = {k: v.full_tensor().clone() for k, v in model.state_dict().items()}
    good = {k: v * 0 for k, v in model.state_dict().items()}  # would zero every weight
    cases = {
        "missing": {k: v for k, v in good.items() if k != "2.bias"},
        "shape": {**good, "0.weight": torch.zeros(5, 4)},
        "plain": {**good, "2.weight": torch.zeros(3, 6)},
    }
    messages = {}
    for name, state in cases.items():
        with pytest.raises(RuntimeError) as err:
            model.load_state_dict(state)
        messages[name] = str(err.value)
        for k, v in model.state_dict().items():  # nothing was loaded, not even what fit
            assert torch.equal(v.full_tensor(), before[k]), (name, k)
    missing = {k: v for k, v in good.items() if k != "2.bias"}
    model.load_state_dict(missing, strict=False)  # strict=False: the rest loads
    assert all(torch.equal(v.full_tensor(), torch.zeros_like(v.full_tensor()))
               for k, v in model.state_dict().items() if k != "2.bias")
    return messages


def test_a_state_dict_that_does_not_fit_is_refused_before_anything_is_loaded():
    messages = run_distributed(_refusals, 2)[0]
    assert messages["missing"].startswith("load_state_dict(Sequential): '2.bias' is missing. "
                                          "Nothing was loaded.")
    assert "'0.weight' has shape (5, 4) in the state dict but (6, 4) in the model" in \
        messages["shape"]
    assert messages["plain"].startswith("load_state_dict(Sequential): '2.weight' is a plain "
                                        "tensor in the state dict, but a sharded DTensor")


def _wrapped_round_trip():
    """Units that are torch's checkpoint_wrapper: torch's set_model_state_dict hands the
    keys over without ``_checkpoint_wrapped_module.``, which the wrapper's own load pre-hook
    puts back; the check leaves those subtrees to it (it used to call every key missing)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
    torch.manual_seed(0)
    model = nn.Sequential(checkpoint_wrapper(nn.Linear(4, 6)), nn.ReLU(),
                          checkpoint_wrapper(nn.Linear(6, 3)))
    for i in (0, 2):
        fully_shard(model[i])
    fully_shard(model)
    saved = {k: v.full_tensor().clone() for k, v in get_model_state_dict(model).items()}
    state = {k: v * 0 for k, v in get_model_state_dict(model).items()}
    set_model_state_dict(model, state)
    zeroed = all(torch.equal(v.full_tensor(), torch.zeros_like(saved[k]))
                 for k, v in get_model_state_dict(model).items())
    return sorted(saved), zeroed


def test_torch_set_model_state_dict_loads_units_that_are_checkpoint_wrappers():
    keys, zeroed = run_distributed(_wrapped_round_trip, 2)[0]
    assert keys == ["0.bias", "0.weight", "2.bias", "2.weight"] and zeroed
