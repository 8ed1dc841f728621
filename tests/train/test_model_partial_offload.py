"""--parallel.offload cpu:FRACTION: the last blocks' shards, gradients and optimizer
states on the host, the rest on the device; disk:PATH:FRACTION: the same with those
blocks' states in files. Training computes what it computes with nothing offloaded, and
resumes exactly."""

import os

import pytest

from fullshard.core.param import owner_of
from fullshard.gpt import GPT, GPTConfig
from fullshard.optim import states_on_disk
from fullshard.offload.fraction import disk_path_and_fraction, offloaded_blocks
from fullshard.policies import DiskOffloadPolicy
from fullshard.testing import run_distributed
from fullshard.train.config.schema import ParallelConfig
from fullshard.train.model import unit_offload
from support.train_runs import assert_resumed_exactly, straight_and_resumed, train_losses


def test_a_fraction_offloads_the_last_blocks_rounded_up():
    assert offloaded_blocks("abcd", 0.5) == ["c", "d"]
    assert offloaded_blocks("abcd", 0.1) == ["d"]
    assert offloaded_blocks("abcdefghij", 0.3) == ["h", "i", "j"]  # 0.3 * 10 is 3, not 4
    assert offloaded_blocks("abcd", 1.0) == list("abcd")


def test_units_outside_the_offloaded_blocks_stay_on_the_device():
    model = GPT(GPTConfig(vocab_size=16, seq_len=4, d_model=8, n_layers=4, n_heads=2))
    offload_of = unit_offload(model, ParallelConfig(offload="cpu:0.5"))
    assert [offload_of(b) is not None for b in model.layers] == [False, False, True, True]
    assert offload_of(model) is None
    whole = unit_offload(model, ParallelConfig(offload="cpu"))
    assert whole(model) is not None and whole(model.layers[0]) is not None


def test_a_disk_fraction_puts_the_last_blocks_states_in_files(tmp_path):
    model = GPT(GPTConfig(vocab_size=16, seq_len=4, d_model=8, n_layers=4, n_heads=2))
    offload_of = unit_offload(model, ParallelConfig(offload=f"disk:{tmp_path}:0.25",
                                                    offload_params=True))
    policies = [offload_of(b) for b in model.layers]
    assert policies[:3] == [None] * 3 and offload_of(model) is None
    assert isinstance(policies[3], DiskOffloadPolicy)
    assert (policies[3].path, policies[3].params) == (str(tmp_path), True)


def test_a_directory_named_with_a_colon_and_a_number_is_a_path_whole(tmp_path):
    """``disk:PATH:FRACTION`` splits at the last colon only where PATH:FRACTION is not
    itself a directory."""
    odd = tmp_path / "states:0.5"
    assert disk_path_and_fraction(str(odd)) == (str(tmp_path / "states"), 0.5)
    os.mkdir(odd)
    assert disk_path_and_fraction(str(odd)) == (str(odd), 1.0)
    assert disk_path_and_fraction(f"{odd}:0.25") == (str(odd), 0.25)
    assert disk_path_and_fraction(str(tmp_path / "states:x")) == (str(tmp_path / "states:x"), 1.0)
    with pytest.raises(ValueError, match=r"disk:.*:0 is outside 0 < FRACTION <= 1"):
        disk_path_and_fraction(f"{tmp_path}:0")


def _both(fraction: str) -> dict[str, list[float]]:
    return {name: train_losses({"batch.batch_size": 4, "parallel.offload": value})
            for name, value in {"device": "none", "partial": fraction}.items()}


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=[pytest.mark.slow,
                                                            pytest.mark.extended])])
def test_partial_offload_trains_as_nothing_offloaded(world):
    losses = run_distributed(_both, world, "cpu:0.5")[0]
    assert len(losses["device"]) == 4 and losses["device"][-1] < losses["device"][0]
    assert losses["partial"] == pytest.approx(losses["device"], rel=1e-5, abs=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("world, params", [(2, False), pytest.param(3, True,
                                                                    marks=pytest.mark.extended)])
def test_states_of_a_fraction_on_disk_train_as_nothing_offloaded(tmp_path, world, params):
    """disk:PATH:0.5 (with the parameters of those blocks on disk too at world 3)."""
    losses = run_distributed(_both_on_disk, world, f"disk:{tmp_path}:0.5", params)[0]
    # the debug preset's second block of two, and nothing else
    assert losses["on disk"] and all(n.startswith("layers.1.") for n in losses["on disk"])
    assert len(losses["device"]) == 4 and losses["device"][-1] < losses["device"][0]
    assert losses["partial"] == pytest.approx(losses["device"], rel=1e-5, abs=1e-5)


def _both_on_disk(offload: str, params: bool) -> dict[str, list]:
    """The losses with nothing offloaded and with ``offload``, and the blocks whose
    parameters the latter steps on disk."""
    trainers: list = []
    out = {"device": train_losses({"batch.batch_size": 4}),
           "partial": train_losses({"batch.batch_size": 4, "parallel.offload": offload,
                                    "parallel.offload_params": params}, keep=trainers)}
    out["on disk"] = [name for name, p in trainers[0].model.named_parameters()
                      if states_on_disk(owner_of(p))]
    return out


def _resume(out: str, offload: str) -> dict[str, list[float]] | None:
    return straight_and_resumed(out, {"parallel.offload": offload, "batch.batch_size": 2})[0]


@pytest.mark.slow
@pytest.mark.parametrize("offload", ["cpu:0.5", "disk:{states}:0.5"])
def test_partial_offload_resumes_exactly(tmp_path, offload):
    os.mkdir(tmp_path / "states")
    runs = run_distributed(_resume, 2, str(tmp_path / "run"),
                           offload.format(states=tmp_path / "states"))[0]
    assert_resumed_exactly(runs)


def _overlap_on_and_off(offload: str) -> dict[str, list[float]]:
    return {name: train_losses({"batch.batch_size": 4, "parallel.offload": offload,
                                "parallel.overlap_step": on})
            for name, on in {"off": False, "on": True}.items()}


@pytest.mark.slow
@pytest.mark.parametrize("offload", ["cpu", "cpu:0.5", "disk:{states}:0.5"])
def test_the_step_overlapped_with_forward_trains_bit_for_bit_as_stepping_first(offload,
                                                                               tmp_path):
    losses = run_distributed(_overlap_on_and_off, 2, offload.format(states=tmp_path))[0]
    assert len(losses["on"]) == 4 and losses["on"] == losses["off"]
