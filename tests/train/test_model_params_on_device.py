"""--parallel.params_on_device true: the offloaded blocks keep a copy of their sharded
parameters on the device that their gathers read (CPUOffloadPolicy(params_on_device=True),
Note [parameters kept on the device]). Training computes what it computes without it, bit
for bit, resumes exactly, and the flag is refused where nothing offloaded is on the host."""

import os

import pytest

from fullshard.testing import run_distributed
from fullshard.errors import ConfigError
from fullshard.train.config.flags import apply_overrides
from fullshard.train.config.schema import get_preset, validate
from support.catalogue import matches_documented
from support.train_runs import assert_resumed_exactly, straight_and_resumed, train_losses


def _with_and_without(offload: str, precision: str) -> dict:
    trainers: list = []
    base = {"batch.batch_size": 4, "parallel.offload": offload,
            "parallel.precision": precision}
    out = {"copied": train_losses(base),
           "kept": train_losses({**base, "parallel.params_on_device": True}, keep=trainers)}
    model = trainers[0].model
    groups = [unit._unit.group for unit in (model, *model.layers)]
    out["copies"] = [g.storage.device_copy is not None for g in groups if g.offload is not None]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("offload, precision", [("cpu:0.5", "bf16"), ("disk:{states}", "fp32")])
def test_the_same_losses_bit_for_bit_as_copying_from_the_host(tmp_path, offload, precision):
    runs = run_distributed(_with_and_without, 2, offload.format(states=tmp_path),
                           precision)[0]
    assert len(runs["kept"]) == 4 and runs["kept"] == runs["copied"]
    assert runs["copies"] and all(runs["copies"]), runs["copies"]


def _resume(out: str) -> dict | None:
    return straight_and_resumed(out, {"parallel.offload": "cpu", "batch.batch_size": 2,
                                      "parallel.precision": "bf16",
                                      "parallel.params_on_device": True})[0]


@pytest.mark.slow
def test_a_resume_trains_on_exactly(tmp_path):
    runs = run_distributed(_resume, 2, str(tmp_path))[0]
    assert_resumed_exactly(runs)


def _config(tmp_path, **fields):
    return validate(apply_overrides(get_preset("debug"),
                                    {f"parallel.{k}": v for k, v in fields.items()}, "test"))


def test_refused_where_nothing_offloaded_is_on_the_host(tmp_path):
    with pytest.raises(ConfigError) as none:
        _config(tmp_path, params_on_device=True)
    assert matches_documented("E387", f"ConfigError: {none.value}")
    os.mkdir(tmp_path / "states")
    with pytest.raises(ConfigError, match="offload_params true pages them from files"):
        _config(tmp_path, params_on_device=True, offload=f"disk:{tmp_path / 'states'}",
                offload_params=True)
