"""Building the trainer's models (train/model.py): the presets' parameter counts, on the
meta device, and an initialized debug model."""

from fullshard.train.config.schema import PRESETS, get_preset, validate
from fullshard.train.model import build_model, preset_model


def test_preset_models_have_their_parameter_counts_on_meta():
    expected = {"gpt2-124m": 124_439_808, "llama-1b": 1_072_599_040}
    for name, cfg in PRESETS.items():
        validate(get_preset(name))
        model = preset_model(name)
        assert all(p.is_meta for p in model.parameters())
        count = sum(p.numel() for p in model.parameters())
        assert count == cfg.gpt.num_params() == expected.get(name, count), name
    shakespeare = PRESETS["shakespeare"]
    assert shakespeare.batch.seq_len <= shakespeare.gpt.seq_len
    assert build_model(PRESETS["debug"].gpt).lm_head.weight.abs().sum() > 0  # initialized
