"""Misuse gets a clear error that names the module or parameter and says what to do."""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from fullshard import MixedPrecisionPolicy, fully_shard
from fullshard.testing import run_distributed
from fullshard.gpt import GPT, GPTConfig

CFG = GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_layers=2, n_heads=2)


def test_no_process_group():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match=r"fully_shard\(Linear\): no process group .*"
                                           r"init_process_group"):
        fully_shard(nn.Linear(2, 2))


def _raises(fn, exc, pattern):
    with pytest.raises(exc, match=pattern):
        fn()


def _twice():
    m = nn.Linear(4, 4)
    fully_shard(m)
    _raises(lambda: fully_shard(m), ValueError, r"already applied to this Linear")


def _shared_across_units():
    model = GPT(CFG)  # tok_emb.weight is lm_head.weight
    fully_shard(model.tok_emb)
    _raises(lambda: fully_shard(model), ValueError,
            r"parameter 'lm_head.weight' is also managed by fully_shard\(Embedding\).*"
            r"common parent")


def _wrong_mesh():
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (1, 1, 2), mesh_dim_names=("a", "b", "c"))
    _raises(lambda: fully_shard(nn.Linear(4, 4), mesh=mesh), ValueError,
            r"fully_shard\(Linear\): mesh has 3 dimensions \(1, 1, 2\).*\(replicate, shard\)")
    _raises(lambda: fully_shard(nn.Linear(4, 4), mesh="cpu"), TypeError, r"DeviceMesh")


def _meta_at_forward():
    with torch.device("meta"):
        model = GPT(CFG)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    _raises(lambda: model(torch.zeros(1, 4, dtype=torch.long)), RuntimeError,
            r"parameter 'tok_emb.weight' is still on the meta device.*to_empty")


def _unsupported_options():
    _raises(lambda: fully_shard(nn.Linear(2, 2), mp_policy=MixedPrecisionPolicy(
        param_dtype=torch.int8)), ValueError,
        r"fully_shard\(Linear\): mp_policy.param_dtype=torch.int8 is not a floating-point")
    _raises(lambda: fully_shard(nn.Linear(2, 2), offload_policy="cpu"),
            TypeError, r"offload_policy must be OffloadPolicy\(\), CPUOffloadPolicy\(\) "
                       r"\(fullshard's or torch.distributed.fsdp's\), "
                       r"DiskOffloadPolicy\(path=...\) or None, got str")
    _raises(lambda: fully_shard(nn.Linear(2, 2), reshard_after_forward=3),
            ValueError, r"reshard_after_forward=3 must divide the shard group size 2")
    _raises(lambda: fully_shard(nn.Linear(2, 2), reshard_after_forward="yes"),
            TypeError, r"reshard_after_forward must be a bool or an int")
    _raises(lambda: fully_shard([]), ValueError, r"got an empty list of modules")
    _raises(lambda: fully_shard([nn.Linear(2, 2), "layer"]), TypeError,
            r"expected an nn.Module or a list of them, got str at index 1")


def _bad_modules():
    _raises(lambda: fully_shard(nn.ModuleList([nn.Linear(2, 2)])), ValueError,
            r"fully_shard\(ModuleList\): this module has no forward")

    class Scalar(nn.Module):
        def __init__(self):
            super().__init__()
            self.temperature = nn.Parameter(torch.tensor(1.0))

        def forward(self, x):
            return x * self.temperature
    _raises(lambda: fully_shard(Scalar()), ValueError,
            r"parameter 'temperature' is 0-dimensional")
    mixed = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2).double())
    _raises(lambda: fully_shard(mixed), TypeError,
            r"fully_shard\(Sequential\): all parameters of one unit must share a dtype.*"
            r"1.weight: torch.float64")


def _replaced_by_plain_tensor():
    model = nn.Linear(4, 4)
    fully_shard(model)
    before = {k: v.to_local().clone() for k, v in model.state_dict().items()}
    for assign in (False, True):  # refused before anything is copied or assigned
        _raises(lambda: model.load_state_dict({"weight": torch.zeros(4, 4),
                                               "bias": torch.zeros(4)}, assign=assign),
                RuntimeError, r"load_state_dict\(Linear\): 'weight' \(and 1 more\) is a plain "
                r"tensor in the state dict, but a sharded DTensor in the model\. Nothing was "
                r"loaded\..*full_state_dict=True")
    assert all(torch.equal(v.to_local(), before[k]) for k, v in model.state_dict().items())
    model.weight = nn.Parameter(torch.zeros(4, 4))  # assigned by hand: named at the forward
    _raises(lambda: model(torch.randn(2, 4)), TypeError,
            r"parameter 'weight' was replaced by a plain tensor.*distribute_tensor")


def _bucket_after_first_forward():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    fully_shard(model[0])
    fully_shard(model)
    _raises(lambda: model.set_bucket_numel(-1), ValueError, r"numel must be an int >= 0")
    model(torch.ones(2, 4))
    _raises(lambda: model.set_bucket_numel(0), RuntimeError,
            r"set_bucket_numel on Sequential: the units were already grouped")


def _dtype_the_device_cannot_compute_in():
    import fullshard.core.init as init

    init._COMPUTABLE[(torch.device("cpu"), torch.float16)] = False  # as on a GPU without it
    try:
        _raises(lambda: fully_shard(nn.Linear(2, 2), mp_policy=MixedPrecisionPolicy(
            param_dtype=torch.float16)), ValueError,
            r"fully_shard\(Linear\): mp_policy.param_dtype=torch.float16 cannot be computed "
            r"in on cpu")
    finally:
        del init._COMPUTABLE[(torch.device("cpu"), torch.float16)]
    assert init.can_compute_in(torch.device("cpu"), torch.bfloat16)


def _bad_toggles():
    model = nn.Sequential(nn.Linear(4, 4))
    fully_shard(model)
    _raises(lambda: model.set_requires_gradient_sync("no"), TypeError,
            r"set_requires_gradient_sync: expected a bool, got str")
    _raises(lambda: model.set_reshard_after_backward(None), TypeError,
            r"set_reshard_after_backward: expected a bool, got NoneType")


def _torch_and_fullshard_mixed():
    """Code that bound torch's fully_shard before fullshard.install() and mixes the two
    names: install() names the binding, and each mix is refused naming the submodule."""
    import sys
    import types
    import warnings

    import fullshard
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    early = types.ModuleType("early_user_code")  # it imported torch's name before install()
    early.fully_shard = torch_fully_shard
    sys.modules["early_user_code"] = early
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fullshard.install()
        assert any(issubclass(w.category, fullshard.InstallOrderWarning)
                   and "early_user_code.fully_shard (torch's fully_shard)" in str(w.message)
                   for w in caught), [str(w.message) for w in caught]
        torch_child = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        early.fully_shard(torch_child[0])
        _raises(lambda: fully_shard(torch_child), ValueError,
                r"fully_shard\(Sequential\): submodule '0' was sharded by torch's fully_shard "
                r".*call install\(\) before that import")
        fullshard_child = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        fully_shard(fullshard_child[1])
        _raises(lambda: early.fully_shard(fullshard_child), ValueError,
                r"torch's fully_shard\(Sequential\): submodule '1' is sharded by fullshard's "
                r"fully_shard, not torch's")
    finally:
        fullshard.uninstall()
        del sys.modules["early_user_code"]


CHECKS = {f.__name__: f for f in (
    _torch_and_fullshard_mixed,
    _dtype_the_device_cannot_compute_in, _bad_toggles, _bucket_after_first_forward, _twice, _shared_across_units, _wrong_mesh, _meta_at_forward,
    _unsupported_options, _bad_modules, _replaced_by_plain_tensor)}


def _run_check(name):
    CHECKS[name]()
    return True


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_clear_error(name):
    assert all(run_distributed(_run_check, 2, name))


class _FailingWork:
    def __init__(self, error):
        self.error = error

    def wait(self):
        raise self.error


def _collective_failures():
    from fullshard.core.comm import CollectiveError, Pending

    messages = []
    for error in (RuntimeError("Inplace update to inference tensor outside InferenceMode"),
                  RuntimeError("[gloo] Timed out waiting 8000ms for recv operation"),
                  dist.DistBackendError("NCCL communicator was aborted")):
        with pytest.raises(CollectiveError) as failed:
            Pending(torch.empty(1), _FailingWork(error)).wait("all-gather of layers.0")
        messages.append(str(failed.value))
    return messages


def test_a_failed_collective_blames_diverged_ranks_only_when_ranks_are_the_cause():
    local, timed_out, aborted = run_distributed(_collective_failures, 1)[0]
    assert local == ("fullshard: all-gather of layers.0 failed on rank 0: Inplace update to "
                     "inference tensor outside InferenceMode")
    for message in (timed_out, aborted):
        assert message.startswith("fullshard: all-gather of layers.0 failed on rank 0: ")
        assert "ranks probably took different paths" in message
