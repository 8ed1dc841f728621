"""``fullshard estimate`` on the command line (cli/memory.py): one estimate, a sweep over
strategies, the ZeRO table, and the expert-parallel degree; and the partial offload
``fullshard plan`` prints, as the trainer reads it."""

import pytest

from fullshard.cli import main
from fullshard.cli.memory import estimate_main


def test_cli_estimate_sweep_and_zero_table(capsys):
    assert estimate_main(["--preset", "debug", "--world-size", "2", "--batch", "2"]) == 0
    assert "peak per rank" in capsys.readouterr().out
    assert estimate_main(["--preset", "debug", "--world-size", "4", "--sweep"]) == 0
    out = capsys.readouterr().out
    assert "no_shard" in out and len(out.strip().splitlines()) == 5  # title, head, 1 2 4
    assert estimate_main(["--zero-table", "--params", "7.5e9", "--world-size", "64"]) == 0
    assert "31.406" in capsys.readouterr().out


def test_estimate_cli_takes_the_expert_parallel_degree(capsys):
    peaks = {}
    for ep in ("1", "4"):
        assert estimate_main(["--preset", "moe", "--world-size", "4", "--ep", ep,
                              "--batch", "1"]) == 0
        text = capsys.readouterr().out
        peaks[ep] = float(text.split("peak per rank")[1].split("MiB")[0].split()[-1])
        assert ("experts split over 4 ranks" in text) == (ep == "4")
    # ep 4 over 4 ranks: a rank's experts are whole on it, nothing of them gathered
    assert peaks["4"] < peaks["1"]


@pytest.mark.parametrize("flags, says", [
    (["--preset", "moe", "--world-size", "4", "--ep", "3"], "ep=3 must divide world_size 4"),
    (["--preset", "moe", "--world-size", "4", "--ep", "2", "--strategy", "no_shard"],
     "not no_shard"),
    (["--preset", "debug", "--world-size", "4", "--ep", "2"], "has none: leave ep at 1"),
], ids=["not dividing", "strategy", "no experts"])
def test_an_expert_parallel_degree_the_run_cannot_take_is_a_usage_error(capsys, flags, says):
    assert main(["estimate", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("fullshard estimate: --ep: ") and says in err, err
    assert len(err.splitlines()) == 1 and "ValueError" not in err


def _peak_bytes_of(capsys, offload: str) -> float:
    assert estimate_main(["--preset", "shakespeare", "--world-size", "2", "--batch", "2",
                          "--offload", offload]) == 0
    line = next(l for l in capsys.readouterr().out.splitlines() if "peak per rank" in l)
    return float(line.split()[-2].replace(",", ""))


def test_estimate_takes_a_fraction_to_offload_as_the_trainer_does(capsys):
    device = {o: _peak_bytes_of(capsys, o) for o in ("none", "cpu:0.5", "cpu")}
    assert device["none"] > device["cpu:0.5"] > device["cpu"], device


@pytest.mark.parametrize("value", ["cpu:0", "cpu:1.5", "cpu:abc", "ssd"])
def test_a_fraction_estimate_cannot_take_is_a_usage_error(capsys, value):
    with pytest.raises(SystemExit) as exit_:
        estimate_main(["--preset", "debug", "--offload", value])
    assert exit_.value.code == 2
    said = capsys.readouterr().err
    assert said.startswith("fullshard estimate: --offload: ") and len(said.splitlines()) == 1


@pytest.mark.slow
def test_plan_prints_a_partial_offload_the_trainer_runs_with_the_same_blocks(capsys):
    """GPT-2 124M on two ranks of 2.1 GiB: the plan offloads 2 of its 12 blocks (with
    checkpointing), and the command it prints, read by `fullshard train`'s own parser,
    offloads exactly those 2."""
    import re

    import torch

    from fullshard.cli.memory import plan_main
    from fullshard.cli.train import build_parser, resolve_config
    from fullshard.gpt import GPT
    from fullshard.train.model import unit_offload

    assert plan_main(["--preset", "gpt2-124m", "--world-size", "2", "--budget-gib", "2.1",
                      "--allow-offload"]) == 0
    out = capsys.readouterr().out
    k, blocks = map(int, re.search(r"offload of the last (\d+) of (\d+) blocks", out).groups())
    assert (k, blocks) == (2, 12), out
    command = out.strip().splitlines()[-1]
    assert f"--parallel.offload cpu:{2 / 12!r}" in command
    cfg, _ = resolve_config(build_parser().parse_args(command.split()[2:]))
    assert cfg.parallel.activation_checkpointing
    with torch.device("meta"):
        model = GPT(cfg.gpt)
    policy_of = unit_offload(model, cfg.parallel)
    assert [policy_of(b) is not None for b in model.layers] == [False] * 10 + [True] * 2


def _host_mib(text: str) -> float:
    line = next(l for l in text.splitlines() if "host memory for offloaded states" in l)
    return float(line.split()[-2].replace(",", ""))


def test_estimate_counts_the_delayed_update_as_the_trainer_runs_it(capsys):
    """--delayed-update N adds each offloaded block's copy of its shard and second gradient
    buffer to the host memory, and nothing to the device."""
    flags = ["--preset", "shakespeare", "--world-size", "2", "--batch", "2", "--offload",
             "cpu:0.5"]
    assert estimate_main(flags) == 0
    exact = capsys.readouterr().out
    assert estimate_main(flags + ["--delayed-update", "3"]) == 0
    delayed = capsys.readouterr().out
    assert ", delayed update," in delayed.splitlines()[0]
    assert _host_mib(delayed) > _host_mib(exact)
    peak = [next(l for l in t.splitlines() if "peak per rank" in l) for t in (exact, delayed)]
    assert peak[0] == peak[1]


@pytest.mark.parametrize("argv, names", [
    (["estimate", "--world-size", "2", "--offload", "disk", "--delayed-update", "0"],
     "--offload disk"),
    (["plan", "--world-size", "2", "--budget-gib", "1", "--allow-offload", "--offload-dir",
      ".", "--delayed-update", "0"], "--offload-dir")], ids=["estimate", "plan"])
def test_the_delayed_update_beside_disk_offload_is_a_usage_error(capsys, argv, names):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"fullshard {argv[0]}: --delayed-update: ") and names in err, err
    assert len(err.splitlines()) == 1


def test_plan_prints_the_delayed_update_for_an_offloaded_choice(capsys):
    """The command plan prints runs the delayed update it counted, read back by
    `fullshard train`'s parser; a choice without offload has nothing to delay."""
    from fullshard.cli.memory import plan_main
    from fullshard.cli.train import build_parser, resolve_config

    flags = ["--preset", "shakespeare", "--world-size", "2", "--batch", "1", "--allow-offload",
             "--delayed-update", "3"]
    assert plan_main(flags + ["--budget-gib", "0.05"]) == 0
    command = capsys.readouterr().out.strip().splitlines()[-1]
    assert "--parallel.offload cpu:" in command, command
    cfg, _ = resolve_config(build_parser().parse_args(command.split()[2:]))
    assert cfg.parallel.delayed_update == 3
    assert plan_main(flags + ["--budget-gib", "8"]) == 0
    assert "delayed_update" not in capsys.readouterr().out.strip().splitlines()[-1]


def test_a_host_budget_counts_the_delayed_copies():
    """A host budget the exact offload fits and the delayed one does not: plan rules the
    delayed candidate out where it would have chosen it."""
    from fullshard.memory import plan

    kwargs = dict(world_size=2, budget_bytes=int(0.03 * 2 ** 30), batch_size=1,
                  allow_offload=True)
    exact = plan("shakespeare", **kwargs)
    host = exact.estimate.host_bytes
    assert host > 0
    fits = plan("shakespeare", host_budget_bytes=int(host * 1.1) + 1, **kwargs)
    assert fits.choice == exact.choice
    delayed = plan("shakespeare", host_budget_bytes=int(host * 1.1) + 1,
                   delayed_update=True, **kwargs)
    assert delayed.choice != exact.choice
    assert any(nbytes < 0 for _cand, nbytes in delayed.rejected)  # over the host budget
