"""``fullshard project`` and ``fullshard plan --gpus`` on the command line."""

from __future__ import annotations

import pytest

from fullshard.cli import main

from test_error_catalogue import matches_documented


# -- command line ---------------------------------------------------------------------------
def test_project_prints_each_strategy_and_world_size(capsys):
    assert main(["project", "--model", "llama3-8b", "--gpus", "8,128", "--batch", "2",
                 "--seq", "8192", "--ac", "selective"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.strip().startswith(("8 ", "128 "))]
    assert len(rows) == 3 + 4  # hybrid_shard needs more than one node
    assert "llama3-8b (8,030.3M parameters) on h100," in out


def test_plan_ranks_by_throughput_prints_flags_and_plots(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    plot = tmp_path / "plan.png"
    assert main(["plan", "--gpus", "64", "--gpu", "h100", "--nodes-of", "8", "--model",
                 "llama3-8b", "--batch", "4", "--seq", "4096", "--plot", str(plot)]) == 0
    out = capsys.readouterr().out
    flags = [line for line in out.splitlines() if line.startswith("fullshard train")]
    assert len(flags) == 1 and "--nnodes 8" in flags[0] and "--nproc 8" in flags[0]
    assert plot.stat().st_size > 10_000


def test_plan_says_when_nothing_fits(capsys):
    assert main(["plan", "--gpus", "8", "--model", "llama3-70b", "--memory-gib", "8",
                 "--plot", ""]) == 1
    assert "nothing fits" in capsys.readouterr().out


@pytest.mark.parametrize("argv,code", [
    (["project", "--gpu", "x100"], "E125"),
    (["project", "--gpus", "12", "--nodes-of", "8"], "E126"),
    (["project", "--model", "gpt5"], "E128"),
    (["project", "--gpus", "8", "--strategy", "hybrid_shard"], "E129"),
])
def test_bad_input_is_one_line_naming_it(argv, code, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err
    assert matches_documented(code, "ProjectionError: " + err.split(": ", 1)[1]), err


@pytest.mark.parametrize("argv,flag", [
    (["project", "--batch", "0"], "--batch"),
    (["project", "--gpus", "0"], "--gpus"),
    (["project", "--gpus", "8,x"], "--gpus"),
    (["project", "--seq", "nan"], "--seq"),
    (["plan", "--gpus", "64", "--efficiency", "-1"], "--efficiency"),
    (["plan", "--gpus", "64", "--efficiency", "1.5"], "--efficiency"),
    (["plan", "--gpus", "64", "--inter-gbps", "inf"], "--inter-gbps"),
    (["plan", "--gpus", "64", "--nodes-of", "0"], "--nodes-of"),
])
def test_bad_numbers_are_one_line_naming_the_flag(argv, flag, capsys):
    with pytest.raises(SystemExit) as exit_:
        code = main(argv)
        raise SystemExit(code)
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and flag in err and "Traceback" not in err, err
