"""The command line's edges: what escapes a command is one line, file and directory
arguments are checked when read, ``--help`` lists every field, and flags and TOML give the
same config."""

from __future__ import annotations

import ast
import inspect
import re

import pytest

from fullshard.cli import main
from fullshard.cli import memory as memory_cli
from fullshard.cli import train as train_cli
from fullshard.train.config.schema import (ConfigError, OptimConfig, TrainConfig, get_preset,
                                           scalar_fields, sections, to_toml, validate)
from fullshard.train.config.flags import load_toml
from support.catalogue import matches_documented


def _train_config(*argv: str):
    return train_cli.resolve_config(train_cli.build_parser().parse_args(list(argv)))[0]


def test_an_unexpected_error_is_one_line_exit_1_and_its_traceback_on_request(monkeypatch,
                                                                            capsys):
    def broken(*args, **kwargs):
        raise RuntimeError("the estimator broke\nsecond line")

    monkeypatch.setattr(memory_cli, "estimate", broken)
    monkeypatch.delenv("FULLSHARD_TRACEBACK", raising=False)
    assert main(["estimate", "--preset", "debug", "--world-size", "2"]) == 1
    err = capsys.readouterr().err
    assert err == ("fullshard estimate: RuntimeError: the estimator broke second line (set "
                   "FULLSHARD_TRACEBACK=1 for the traceback)\n")
    assert matches_documented("E82", err.strip())
    monkeypatch.setenv("FULLSHARD_TRACEBACK", "1")
    assert main(["estimate", "--preset", "debug", "--world-size", "2"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("Traceback") and "in broken" in err
    assert err.endswith("fullshard estimate: RuntimeError: the estimator broke second line\n")


def test_a_config_error_from_any_command_is_one_line_exit_2(capsys):
    assert main(["estimate", "--world-size", "6", "--reshard-after-forward", "4"]) == 2
    assert capsys.readouterr().err == ("fullshard estimate: --reshard-after-forward: 4 does "
                                       "not divide --world-size 6; give a divisor of it\n")


@pytest.mark.parametrize("make, argv, message", [
    (lambda d: (d / "b.txt").write_bytes(b"ok\xff\xfe"), ["train", "--data", "{d}/b.txt"],
     "data: {d}/b.txt is not UTF-8 text (byte 0xff cannot be decoded); give a text or "
     "JSONL file"),
    (lambda d: None, ["train", "--data", "{d}/none.txt"], "data: no such file '{d}/none.txt'"),
    (lambda d: (d / "f").write_text("x"), ["train", "--out", "{d}/f"],
     "--out: {d}/f is a file, not a directory; give a directory (it is created if missing)"),
    (lambda d: None, ["train", "--model", "hf:{d}/gone"],
     "model: {d}/gone does not exist; give a Hugging Face model folder or its config.json"),
    (lambda d: None, ["train", "--model", "hf:{d}"],
     "model: {d} has no config.json; give a Hugging Face model folder or its config.json"),
    (lambda d: None, ["train", "--config", "{d}"], "--config: {d} is a directory; give a "
                                                   "TOML file"),
    (lambda d: (d / "c.toml").write_bytes(b"\xff"), ["train", "--config", "{d}/c.toml"],
     "--config: {d}/c.toml is not UTF-8 text; give a TOML file"),
    (lambda d: (d / "config.json").write_text("{"), ["estimate", "--world-size", "2",
                                                     "--hf-config", "{d}"],
     "--hf-config: {d}/config.json is not a JSON config (Expecting property name enclosed in "
     "double quotes: line 1 column 2 (char 1)); give a Hugging Face model folder or its "
     "config.json"),
    (lambda d: (d / "c.json").write_text("[]"), ["train", "--model", "hf:{d}/c.json"],
     'model: {d}/c.json has no "model_type"; it is not a Hugging Face model config'),
    (lambda d: None, ["estimate", "--world-size", "2", "--hf-config", "{d}/gone"],
     "--hf-config: {d}/gone does not exist; give a Hugging Face model folder or its "
     "config.json"),
])
def test_file_and_directory_arguments_are_checked_when_read(tmp_path, capsys, make, argv,
                                                           message):
    make(tmp_path)
    argv = [a.format(d=tmp_path) for a in argv]
    if argv[0] == "train":
        argv += ["--preset", "debug"] + ([] if "--out" in argv else ["--out", str(tmp_path / "o")])
    assert main(argv) == 2
    assert capsys.readouterr().err == f"fullshard {argv[0]}: {message.format(d=tmp_path)}\n"


@pytest.mark.parametrize("name", ["late.txt", "late.jsonl"])
def test_a_file_that_stops_being_text_after_its_first_mib_is_named_when_read(tmp_path, name):
    from fullshard.train.data import read_documents

    path = tmp_path / name
    path.write_bytes(b'{"text": "a"}\n' * (1 << 17) + b'{"text": "\xc3\x28"}\n')
    assert path.stat().st_size > 1 << 20
    _train_config("--preset", "debug", "--data", str(path), "--out", str(tmp_path / "o"))
    with pytest.raises(ConfigError) as err:
        read_documents(str(path))
    assert str(err.value) == (f"data: {path} is not UTF-8 text (byte 0xc3 cannot be decoded); "
                              "give a text or JSONL file")


def _field_docs(cls: type) -> dict[str, str]:
    """Each field's docstring (the string under it), whitespace collapsed."""
    body = ast.parse(inspect.getsource(cls)).body[0].body
    return {a.target.id: " ".join(b.value.value.split()) for a, b in zip(body, body[1:])
            if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr)
            and isinstance(b.value, ast.Constant)}


def test_help_lists_every_field_with_its_docstring_and_the_launch_flags(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    # the help wraps its lines where it likes, also after a comma ("weights,grads")
    flat = re.sub(r",\s+", ",", " ".join(text.split()))
    for flag in ("--nproc", "--max-restarts", "--preset", "--config", "--out", "--resume"):
        assert flag in text
    listed = 0
    for prefix, obj in sections(TrainConfig()):
        docs = _field_docs(type(obj))
        for f in scalar_fields(obj):
            assert f"--{prefix}{f.name.replace('_', '-')} " in text, f.name
            assert re.sub(r",\s+", ",", docs[f.name]) in flat, (f.name, docs[f.name])
            listed += 1
    assert listed == 55
    assert not re.search(r"^\s*-h, --help", text.split("configuration fields")[1], re.M)


def test_a_toml_file_and_the_same_flags_give_one_config_that_round_trips(tmp_path):
    flags = ["--steps", "9", "--optim.lr", "0.02", "--optim.min-lr=0.001",
             "--parallel.reshard_after_forward", "2", "--parallel.compile", "TRUE",
             "--eval.sample-prompt", "ROMEO:\n", "--metrics.wandb", "", "--seed", "-4"]
    (tmp_path / "c.toml").write_text(
        'steps = 9\nseed = -4\n[optim]\nlr = 0.02\nmin_lr = 0.001\n[parallel]\n'
        'reshard_after_forward = 2\ncompile = true\n[eval]\nsample_prompt = "ROMEO:\\n"\n'
        '[metrics]\nwandb = ""\n')
    from_flags = _train_config("--preset", "debug", *flags)
    from_toml = _train_config("--preset", "debug", "--config", str(tmp_path / "c.toml"))
    assert from_flags == from_toml
    assert (from_flags.optim.lr, from_flags.parallel.reshard_after_forward,
            from_flags.parallel.compile, from_flags.eval.sample_prompt) == (0.02, 2, True,
                                                                            "ROMEO:\n")
    # What a run writes is what --resume reads back, "auto" (None) included.
    for cfg in (from_flags, get_preset("shakespeare")):
        (tmp_path / "w.toml").write_text(to_toml(cfg))
        assert load_toml(TrainConfig(), str(tmp_path / "w.toml")) == cfg
    assert 'reshard_after_forward = "auto"' in to_toml(get_preset("shakespeare"))


@pytest.mark.parametrize("toml, message", [
    ('data = ["a.txt"]\n', "data: expected a number, true/false or text, got ['a.txt']"),
    ("[optim]\nlr = true\n", "optim.lr: expected a number, got 'true'"),
    ("[batch]\nbatch_size = 2.5\n", "batch.batch_size: expected an int, got '2.5'"),
    ("[parallel]\nstrategy = \"zero3\"\n", "parallel.strategy: accepted values are "
                                           "full_shard, shard_grad_op, zero1, hybrid_shard, no_shard; "
                                           "got 'zero3'"),
    ("[optimizer]\nlr = 1\n", "unknown section [optimizer] (sections: gpt, batch, optim, "
                              "parallel, eval, checkpoint, metrics, lora)"),
])
def test_a_bad_toml_value_names_the_file_and_the_field(tmp_path, capsys, toml, message):
    (tmp_path / "c.toml").write_text(toml)
    assert main(["train", "--preset", "debug", "--config", str(tmp_path / "c.toml")]) == 2
    assert capsys.readouterr().err == f"fullshard train: {tmp_path}/c.toml: {message}\n"


def test_preset_then_toml_then_flags_each_override_the_one_before(tmp_path):
    (tmp_path / "c.toml").write_text("steps = 30\n[optim]\nlr = 0.01\nwarmup_steps = 3\n")
    cfg = _train_config("--preset", "debug", "--config", str(tmp_path / "c.toml"),
                        "--optim.lr", "0.05")
    preset = get_preset("debug")
    assert (cfg.steps, cfg.optim.lr, cfg.optim.warmup_steps) == (30, 0.05, 3)
    assert cfg.batch == preset.batch and cfg.gpt == preset.gpt


@pytest.mark.parametrize("change, message", [
    ({"optim": OptimConfig(lr=float("nan"))}, "optim.lr: must be a finite number in [0, 10], "
                                              "got nan"),
    ({"optim": OptimConfig(beta2=1.0)}, "optim.beta2: must be in [0, 1), got 1.0"),
    ({"steps": 10 ** 13}, "steps: must be in [1, 1000000000000], got 10000000000000"),
])
def test_configs_built_in_python_are_checked_as_strictly_as_flags(change, message):
    import dataclasses

    with pytest.raises(ConfigError) as err:
        validate(dataclasses.replace(get_preset("debug"), **change))
    assert str(err.value) == message


def test_a_refusal_the_hook_does_not_word_still_comes_out_as_one_line(monkeypatch):
    from fullshard.train.config import flags

    monkeypatch.setattr(flags._Hook, "message", lambda self, event: None)  # tyro's own box
    with pytest.raises(ConfigError) as err:
        flags.parse_flags(get_preset("debug"), ["--steps", "ten"])
    message = str(err.value)
    assert "\n" not in message and message.startswith("command line: ")
    assert "--steps" in message and "'ten'" in message and "─" not in message


@pytest.mark.parametrize("argv,code", [
    (["missing.py"], "E165"), (["-m", "no_such_module"], "E166"), (["-m", "json"], None)])
def test_fullshard_run_names_a_program_it_cannot_open_in_one_line(argv, code, tmp_path,
                                                                  monkeypatch):
    """As `python missing.py` does: one line, exit code 2, no traceback; `-m json` (a
    package without __main__) is named as such."""
    from fullshard.run import main
    from support.catalogue import matches_documented, run_stderr_of

    monkeypatch.chdir(tmp_path)
    line = run_stderr_of(*argv)
    assert "\n" not in line and "Traceback" not in line, line
    if code:
        assert matches_documented(code, line), line
    else:
        assert "'json' is a package without a __main__ module" in line, line
    import fullshard
    try:
        with pytest.raises(SystemExit) as exit_:
            main(argv)
    finally:
        fullshard.uninstall()
    assert exit_.value.code == 2


def test_an_export_to_an_existing_directory_is_one_line_and_leaves_nothing(tmp_path, capsys):
    import torch

    from fullshard import checkpoint

    step = checkpoint.save(str(tmp_path / "run" / "step_1"), torch.nn.Linear(2, 2))
    target = tmp_path / "exported"
    target.mkdir()
    assert main(["ckpt", "export", step, str(target)]) == 2
    err = capsys.readouterr().err.strip()
    assert matches_documented("E244", "ConfigError: " + err.split(": ", 1)[1]), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exported", "run"]  # no .partial
