"""The trainer's parts that need no processes: config, presets, data order, schedule, plot."""

import math
import struct
import zlib

import pytest
import torch

from fullshard.cli import train as train_cli
from fullshard.train.config import (PRESETS, ConfigError, OptimConfig, apply_overrides,
                                    get_preset, load_toml, to_toml, validate)
from fullshard.train.data import EpochSampler, validation_batches
from fullshard.train.loop import learning_rate
from fullshard.train.metrics import plot_losses
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


@pytest.mark.parametrize("flags, message", [
    (["--parallel.strategy", "zero3"], "parallel.strategy: accepted values are full_shard, "
                                       "shard_grad_op, hybrid_shard, no_shard; got 'zero3'"),
    (["--parallel.precision", "fp8"], "parallel.precision: accepted values are fp32, bf16, fp16"),
    (["--steps", "ten"], "steps: expected an int, got 'ten'"),
    (["--batch.batch-size", "0"], "batch.batch_size: must be >= 1, got 0"),
    (["--gpt.n-heads", "3"], "gpt: d_model=256 is not divisible by n_heads=3"),
    (["--model", "llama"], "model: accepted values are gpt or hf:PATH"),
    (["--batch.seq-len", "4096"], "batch.seq_len: 4096 exceeds gpt.seq_len"),
])
def test_bad_values_are_one_line_errors_naming_the_field(flags, message, capsys):
    assert train_cli.main(flags) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_unknown_toml_field_is_named(tmp_path, capsys):
    (tmp_path / "c.toml").write_text("[optim]\nlrr = 0.1\n")
    assert train_cli.main(["--config", str(tmp_path / "c.toml")]) == 2
    assert "unknown field optim.lrr (fields there: beta1," in capsys.readouterr().err


def test_resume_without_a_checkpoint_is_refused_before_launching(tmp_path, capsys):
    assert train_cli.main(["--preset", "debug", "--out", str(tmp_path), "--resume"]) == 2
    assert f"--resume: no checkpoint in {tmp_path}/checkpoints" in capsys.readouterr().err


def test_decay_steps_follow_steps_unless_set():
    args = train_cli.build_parser().parse_args(["--steps", "77", "--optim.decay-steps", "0"])
    assert train_cli.resolve_config(args)[0].optim.decay_steps == 77
    args = train_cli.build_parser().parse_args(["--preset", "debug", "--steps", "40"])
    cfg, out = train_cli.resolve_config(args)
    assert cfg.optim.decay_steps == PRESETS["debug"].optim.decay_steps and out == "runs/debug"


def test_learning_rate_warms_up_then_follows_the_cosine_to_min_lr():
    optim = OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=10, decay_steps=110)
    assert learning_rate(5, optim) == pytest.approx(0.5)
    assert learning_rate(10, optim) == pytest.approx(1.0)
    assert learning_rate(60, optim) == pytest.approx(0.55)  # half way: the mean
    assert learning_rate(110, optim) == pytest.approx(0.1)
    assert learning_rate(500, optim) == pytest.approx(0.1)
    rates = [learning_rate(s, optim) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(rates, rates[1:]))


def _epoch_windows(tokens, world, batch, seq_len, seed, steps):
    samplers = [EpochSampler(tokens, seq_len, batch, r, world, seed) for r in range(world)]
    seen = []
    for _ in range(steps):
        for s in samplers:
            x, y = s.next_batch()
            assert torch.equal(x[:, 1:], y[:, :-1])
            seen += [tuple(row.tolist()) for row in x]
    return samplers, seen


def test_sampler_reads_no_window_twice_per_epoch_and_resumes_exactly():
    tokens = torch.arange(1000)  # every window is recognizable by its first id
    world, batch, seq_len = 3, 2, 10
    samplers, seen = _epoch_windows(tokens, world, batch, seq_len, seed=1, steps=20)
    per_epoch = (1000 - seq_len) // seq_len // (world * batch)  # 99 or more windows: 16
    first_epoch = seen[:per_epoch * world * batch]
    assert len(set(r[0] for r in first_epoch)) == len(first_epoch) == 96
    assert samplers[0].position.epoch == 1  # 20 steps crossed into the second epoch
    # Resuming from a saved position reads what the running samplers read next.
    restored = [EpochSampler(tokens, seq_len, batch, r, world, 1) for r in range(world)]
    for s, r in zip(samplers, restored):
        r.load_state_dict(s.state_dict())
        assert torch.equal(r.next_batch()[0], s.next_batch()[0])
    # Another seed, another order.
    assert _epoch_windows(tokens, world, batch, seq_len, seed=2, steps=1)[1] != seen[:6]


def test_sampler_and_validation_refuse_too_little_data():
    with pytest.raises(ConfigError, match="batch.batch_size"):
        EpochSampler(torch.arange(50), 10, 4, 0, 2, 0)
    with pytest.raises(ConfigError, match="batch.val_fraction"):
        validation_batches(torch.arange(30), 10, 4, 0, 2, 8)
    batches = [validation_batches(torch.arange(200), 10, 2, r, 2, 8) for r in range(2)]
    assert len(batches[0]) == len(batches[1]) == 4  # 19 windows: 4 batches of 2 x 2
    starts = {int(x[i, 0]) for b in batches for x, _ in b for i in range(2)}
    assert len(starts) == 16


def _png_size_and_pixels(data: bytes):
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, {}
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        crc = struct.unpack(">I", data[pos + 8 + length:pos + 12 + length])[0]
        assert zlib.crc32(kind + body) & 0xFFFFFFFF == crc
        chunks[kind] = chunks.get(kind, b"") + body
        pos += 12 + length
    width, height, depth, color = struct.unpack(">IIBB", chunks[b"IHDR"][:10])
    assert (depth, color) == (8, 2)
    raw = zlib.decompress(chunks[b"IDAT"])
    rows = [raw[y * (3 * width + 1) + 1:(y + 1) * (3 * width + 1)] for y in range(height)]
    return width, height, rows


def test_loss_plot_is_a_png_of_the_asked_size_with_both_curves(tmp_path):
    train = [(s, 4.0 * math.exp(-s / 50) + 1.5) for s in range(1, 201)]
    val = [(s, 4.0 * math.exp(-s / 50) + 1.6) for s in (0, 50, 100, 150, 200)]
    path = str(tmp_path / "loss.png")
    plot_losses(path, train, val, width=500, height=300)
    width, height, rows = _png_size_and_pixels(open(path, "rb").read())
    assert (width, height) == (500, 300)
    pixels = {bytes(row[i:i + 3]) for row in rows for i in range(0, len(row), 3)}
    assert bytes((31, 119, 180)) in pixels and bytes((255, 127, 14)) in pixels
    non_white = sum(row[i:i + 3] != b"\xff\xff\xff" for row in rows
                    for i in range(0, len(row), 3))
    assert 2000 < non_white < 0.5 * width * height
    plot_losses(path, [], [])  # before any step: axes only, still a valid PNG
    assert _png_size_and_pixels(open(path, "rb").read())[:2] == (640, 400)


@pytest.mark.parametrize("flags, message", [
    (["--preset", "nope"], "argument --preset: invalid choice: 'nope' (choose from 'debug',"),
    (["--nproc", "x"], "argument --nproc: invalid int value: 'x'"),
])
def test_flag_errors_are_one_line_too(flags, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        train_cli.main(flags)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err and err.count("\n") == 1
