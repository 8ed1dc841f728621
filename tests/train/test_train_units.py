"""The trainer's parts that need no processes: config, presets, data order, schedule,
plot, progress line."""

import io
import math
import re
import sys

import pytest
import torch

from fullshard.cli import train as train_cli
from fullshard.train.config import PRESETS, ConfigError, OptimConfig, get_preset, to_toml, validate
from fullshard.train.flags import apply_overrides, load_toml
from fullshard.train.data import EpochSampler, validation_batches
from fullshard.train.loop import learning_rate, step_or_skip
from fullshard.train.metrics import expected_memory_line
from fullshard.train.plot import NOT_INSTALLED, matplotlib_figure, plot_losses
from fullshard.train.progress import ProgressLine
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
                                       "shard_grad_op, zero1, hybrid_shard, no_shard; got 'zero3'"),
    (["--parallel.precision", "fp8"], "parallel.precision: accepted values are fp32, bf16, fp16"),
    (["--steps", "ten"], "steps: expected an int, got 'ten'"),
    (["--batch.batch-size", "0"], "batch.batch_size: must be in [1, 1048576], got 0"),
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


def _rgb_pixels(path):
    image = pytest.importorskip("PIL.Image").open(path)
    assert image.format == "PNG"
    return image.size, set(image.convert("RGB").getdata())


@pytest.mark.slow
def test_loss_plot_is_a_png_of_the_asked_size_with_both_curves(tmp_path):
    pytest.importorskip("matplotlib")
    train = [(s, 4.0 * math.exp(-s / 50) + 1.5) for s in range(1, 201)]
    val = [(s, 4.0 * math.exp(-s / 50) + 1.6) for s in (0, 50, 100, 150, 200)]
    path = str(tmp_path / "loss.png")
    assert plot_losses(path, train, val, width=500, height=300)
    size, colors = _rgb_pixels(path)
    assert size == (500, 300)
    assert (31, 119, 180) in colors and (255, 127, 14) in colors  # tab:blue, tab:orange
    assert plot_losses(path, [], [])  # before any step: axes only, still a PNG
    size, colors = _rgb_pixels(path)
    assert size == (640, 400) and (31, 119, 180) not in colors


def test_without_matplotlib_no_plot_is_drawn_and_the_notice_names_the_extra(tmp_path,
                                                                            monkeypatch):
    for name in ("matplotlib", "matplotlib.figure"):
        monkeypatch.setitem(sys.modules, name, None)  # what import sees when not installed
    path = tmp_path / "loss.png"
    assert matplotlib_figure() is None
    assert plot_losses(str(path), [(1, 2.0)], [(1, 2.1)]) is False
    assert not path.exists()
    assert "pip install 'fullshard[plot]'" in NOT_INSTALLED and "\n" not in NOT_INSTALLED


def _progress(stream, steps=range(41, 45)):
    line = ProgressLine(steps[0], 60, stream)
    for step in steps:
        line.update(step, 2.5, 12345.6, [2 * 2**20, 3 * 2**20])
        if step == 42:
            line.message("step 42: val loss 2.1000")
    line.close()
    return stream.getvalue()


def test_progress_is_one_line_per_step_off_a_terminal():
    lines = _progress(io.StringIO()).splitlines()
    assert len(lines) == 5 and lines[2] == "step 42: val loss 2.1000"
    assert re.fullmatch(r"step 41/60  loss 2\.5000  12,346 tok/s  peak/rank 2 MiB 3 MiB  "
                        r"elapsed 00:00  eta \d\d:\d\d", lines[0]), lines[0]
    assert [int(line.split()[1].split("/")[0]) for line in lines if "tok/s" in line] == \
        [41, 42, 43, 44]
    assert "\r" not in "".join(lines)


def test_progress_rewrites_one_line_on_a_terminal():
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    text = _progress(Terminal())
    assert "\r" in text and "step 42: val loss 2.1000\n" in text
    assert text.rstrip("\n").split("\r")[-1].startswith("step 44/60  loss 2.5000")


@pytest.mark.parametrize("flags, message", [
    (["--preset", "nope"], "fullshard train: --preset: invalid choice: 'nope' (choose from "
                           "'debug',"),
    (["--nproc", "x"], "fullshard train: --nproc: expected an int in [1, 4096], got 'x'"),
])
def test_flag_errors_are_one_line_too(flags, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        train_cli.main(flags)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err and err.count("\n") == 1


@pytest.mark.slow
def test_gpu_presets_print_their_estimated_memory_before_launching(monkeypatch, capsys):
    from fullshard.memory import estimate

    cfg = get_preset("gpt2-124m")
    expected = estimate("gpt2-124m", world_size=8, mp_policy=torch.bfloat16, batch_size=8,
                        seq_len=1024, device="cuda", process_baseline=0).total
    line = expected_memory_line(cfg, "gpt2-124m", 8, "cuda")
    assert line.startswith(f"gpt2-124m: expected peak memory {expected / 2**30:,.1f} GiB "
                           "per GPU at 8 ranks, bf16, micro-batch 8 x 1024")
    # A larger micro-batch is a larger estimate: computed for the run, not a constant.
    bigger = apply_overrides(cfg, {"batch.batch_size": "16"}, "flags")
    assert expected_memory_line(bigger, "gpt2-124m", 8, "cuda") != line
    launched = []
    monkeypatch.setattr(train_cli, "launch", lambda options, argv: launched.append(argv) or 0)
    assert train_cli.main(["--preset", "llama-1b", "--nproc", "4"]) == 0
    assert launched and "expected peak memory" in capsys.readouterr().err
    assert train_cli.main(["--preset", "debug"]) == 0  # not a GPU preset: no estimate
    assert "expected peak memory" not in capsys.readouterr().err


@pytest.mark.parametrize("fused", [True, False])
def test_a_step_with_a_non_finite_gradient_norm_leaves_weights_and_states_alone(fused):
    """The trainer's step_or_skip: a fused AdamW skips on the device (no host read of the
    norm), any other optimizer after reading it; a finite norm steps."""
    weight = torch.nn.Parameter(torch.ones(8))
    optimizer = torch.optim.AdamW([weight], lr=0.1, fused=fused, foreach=None if fused else False)
    weight.grad = torch.full((8,), 0.5)
    step_or_skip(optimizer, torch.tensor(1.0))
    after_one = weight.detach().clone()
    assert not torch.equal(after_one, torch.ones(8))
    states = {k: v.clone() for k, v in optimizer.state[weight].items()}
    for bad in (float("nan"), float("inf")):
        weight.grad = torch.full((8,), bad)
        step_or_skip(optimizer, torch.tensor(bad))
        assert torch.equal(weight.detach(), after_one)
        for k, v in optimizer.state[weight].items():
            assert torch.equal(v, states[k]), k  # the step count too
    weight.grad = torch.full((8,), 0.5)
    step_or_skip(optimizer, torch.tensor(1.0))
    assert float(optimizer.state[weight]["step"]) == 2.0
    assert not torch.equal(weight.detach(), after_one)
