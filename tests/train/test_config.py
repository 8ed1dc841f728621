"""The trainer's config (train/config/schema.py): a config written as TOML and read back is the
same config, after flags changed it."""

import pytest

from fullshard.train.config.schema import get_preset, to_toml
from fullshard.train.config.flags import apply_overrides, load_toml


def test_toml_round_trip_and_overrides():
    cfg = apply_overrides(get_preset("shakespeare"),
                          {"optim.lr": "3e-4", "parallel.reshard_after_forward": "2",
                           "parallel.activation-checkpointing".replace("-", "_"): "true",
                           "eval.sample_prompt": "ROMEO:\n", "steps": "7"}, "flags")
    assert (cfg.optim.lr, cfg.parallel.reshard_after_forward, cfg.steps) == (3e-4, 2, 7)
    assert cfg.parallel.activation_checkpointing is True
    again = apply_overrides(cfg, {"parallel.reshard_after_forward": "auto"}, "flags")
    assert again.parallel.reshard_after_forward is None
    for c in (cfg, again):
        path = pytest.importorskip("tempfile").mktemp(suffix=".toml")
        with open(path, "w") as f:
            f.write(to_toml(c))
        assert load_toml(get_preset("debug"), path) == c
