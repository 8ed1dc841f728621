"""--parallel.delayed_update N: ZeRO-Offload's one-step delayed update in the trainer
(Note [the delayed update]): a different run from the exact one after N warm-up steps,
and one that resumes exactly (checkpoints are exact points of it)."""

import pytest

from fullshard.testing import run_distributed
from support.train_runs import assert_resumed_exactly, straight_and_resumed, train_losses


def _exact_and_delayed() -> dict[str, list[float]]:
    return {name: train_losses({"batch.batch_size": 4, "parallel.offload": "cpu",
                                "parallel.delayed_update": delay, "steps": 6})
            for name, delay in {"exact": -1, "delayed": 0, "warm": 2}.items()}


@pytest.mark.slow
def test_the_delayed_update_parts_from_the_exact_run_after_its_warm_up():
    losses = run_distributed(_exact_and_delayed, 2)[0]
    exact, delayed, warm = losses["exact"], losses["delayed"], losses["warm"]
    assert len(delayed) == 6 and delayed[-1] < delayed[0]
    # step 2 computes with the parameters before step 1's update: the first to differ
    assert delayed[0] == exact[0] and delayed[1] != exact[1]
    # two exact warm-up steps: steps 1 to 3 see what the exact run sees, step 4 does not
    assert warm[:3] == exact[:3] and warm[3] != exact[3]


def _resume(out: str) -> dict[str, list[float]] | None:
    return straight_and_resumed(out, {"parallel.offload": "cpu", "parallel.delayed_update": 0,
                                      "batch.batch_size": 2})[0]


@pytest.mark.slow
def test_a_delayed_run_resumes_exactly(tmp_path):
    runs = run_distributed(_resume, 2, str(tmp_path))[0]
    assert_resumed_exactly(runs)


@pytest.mark.parametrize("fields, named", [
    ({}, "parallel.offload none"),
    ({"parallel.offload": "cpu", "parallel.overlap_step": False}, "parallel.overlap_step false"),
    ({"parallel.offload": "cpu:0.5", "optim.name": "muon"}, "optim.name muon"),
])
def test_a_delay_no_block_or_only_some_would_take_is_refused_naming_why(fields, named):
    from fullshard.train.config.flags import apply_overrides
    from fullshard.train.config.schema import ConfigError, get_preset, validate
    cfg = apply_overrides(get_preset("debug"), {**fields, "parallel.delayed_update": 1}, "test")
    with pytest.raises(ConfigError, match="parallel.delayed_update 1: ") as info:
        validate(cfg)
    assert named in str(info.value)
