"""``fullshard train``'s command line (cli/train.py), checked in this process: bad values
and flags are one-line errors naming them, defaults that follow other flags, a resume
with nothing to resume, and the memory line printed before a GPU preset launches."""

import pytest
import torch

from fullshard.cli import train as train_cli
from fullshard.train.config.schema import PRESETS, get_preset
from fullshard.train.config.flags import apply_overrides
from fullshard.train.report.metrics import expected_memory_line
from support.catalogue import matches_documented


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


def _steps(tmp_path, *steps):
    from fullshard import checkpoint
    for step in steps:
        checkpoint.save(str(tmp_path / "checkpoints" / f"step_{step:06d}"),
                        torch.nn.Linear(2, 2), extra={"step": step})
    return tmp_path / "checkpoints"


def _check_resume(out):
    args = train_cli.build_parser().parse_args(["--preset", "debug", "--out", str(out),
                                                "--resume"])
    train_cli._check_launch(args, str(out))


@pytest.mark.parametrize("latest", ["missing", "a directory"])
def test_resume_without_a_latest_file_takes_the_newest_step_that_verifies(tmp_path, capsys,
                                                                          latest):
    checkpoints = _steps(tmp_path, 2, 4, 6)
    (checkpoints / "step_000006" / "fullshard.json").unlink()  # a save that did not finish
    (checkpoints / "latest").unlink()
    if latest == "a directory":
        (checkpoints / "latest").mkdir()
    _check_resume(tmp_path)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{checkpoints / 'latest'} is {latest}" in err, err
    assert "resuming from step_000004, the newest checkpoint there that verifies" in err, err
    assert (checkpoints / "latest").read_text() == "step_000004"
    _check_resume(tmp_path)  # latest names it now: nothing more to say
    assert capsys.readouterr().err == ""


def test_resume_without_a_latest_file_names_the_steps_when_none_verifies(tmp_path):
    from fullshard.train.config.schema import ConfigError
    checkpoints = _steps(tmp_path, 2, 4)
    for step in ("step_000002", "step_000004"):
        (checkpoints / step / "fullshard.json").unlink()
    (checkpoints / "latest").unlink()
    with pytest.raises(ConfigError) as err:
        _check_resume(tmp_path)
    assert matches_documented("E245", f"ConfigError: {err.value}"), err.value
