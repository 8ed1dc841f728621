"""--parallel.offload cpu:FRACTION: the last blocks' shards, gradients and optimizer
states on the host, the rest on the device; training computes what it computes with
nothing offloaded, and resumes exactly."""

import pytest

from fullshard.gpt import GPT, GPTConfig
from fullshard.offload.fraction import offloaded_blocks
from fullshard.testing import run_distributed
from fullshard.train.config.schema import ParallelConfig
from fullshard.train.model import unit_offload
from support.train_runs import straight_and_resumed, train_losses


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


def _both(fraction: str) -> dict[str, list[float]]:
    return {name: train_losses({"batch.batch_size": 4, "parallel.offload": value})
            for name, value in {"device": "none", "partial": fraction}.items()}


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_partial_offload_trains_as_nothing_offloaded(world):
    losses = run_distributed(_both, world, "cpu:0.5")[0]
    assert len(losses["device"]) == 4 and losses["device"][-1] < losses["device"][0]
    assert losses["partial"] == pytest.approx(losses["device"], rel=1e-5, abs=1e-5)


def _resume(out: str) -> dict[str, list[float]] | None:
    return straight_and_resumed(out, {"parallel.offload": "cpu:0.5", "batch.batch_size": 2})[0]


@pytest.mark.slow
def test_partial_offload_resumes_exactly(tmp_path):
    runs = run_distributed(_resume, 2, str(tmp_path))[0]
    straight, resumed = runs["straight"], runs["resumed"]
    assert len(straight) == 6 and straight[-1] < straight[0]
    assert resumed[-3:] == straight[-3:]


def _overlap_on_and_off(offload: str) -> dict[str, list[float]]:
    return {name: train_losses({"batch.batch_size": 4, "parallel.offload": offload,
                                "parallel.overlap_step": on})
            for name, on in {"off": False, "on": True}.items()}


@pytest.mark.slow
@pytest.mark.parametrize("offload", ["cpu", "cpu:0.5"])
def test_the_step_overlapped_with_forward_trains_bit_for_bit_as_stepping_first(offload):
    losses = run_distributed(_overlap_on_and_off, 2, offload)[0]
    assert len(losses["on"]) == 4 and losses["on"] == losses["off"]
