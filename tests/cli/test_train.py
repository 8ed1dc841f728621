"""``fullshard train`` as a person runs it: launched, resumed, interrupted (subprocesses)."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from fullshard.testing import run_distributed
from support.train_runs import ENV, TIMEOUT_S, metrics, train_in_process


def _fullshard_train(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fullshard", "train", *args], env=ENV,
                          capture_output=True, text=True, timeout=TIMEOUT_S)


def _checkpoint_step(out) -> int:
    checkpoints = os.path.join(out, "checkpoints")
    with open(os.path.join(checkpoints, "latest")) as f:
        latest = f.read().strip()
    return torch.load(os.path.join(checkpoints, latest, "extra.pt"), weights_only=False)["step"]


@pytest.mark.slow
@pytest.mark.extended  # 36 s through real launches; make test resumes in process (train/)
def test_resume_continues_exactly_like_one_straight_run(tmp_path):
    resumed, straight = str(tmp_path / "resumed"), str(tmp_path / "straight")
    # The first leg under an outside torchrun: the entry point must not launch again.
    first = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
         "2", "-m", "fullshard", "train", "--preset", "debug", "--steps", "40",
         "--out", resumed],
        env=ENV, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert first.returncode == 0, first.stderr[-3000:]
    assert _checkpoint_step(resumed) == 40
    second = _fullshard_train("--preset", "debug", "--steps", "60", "--out", resumed, "--resume")
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resuming at step 40" in second.stderr
    # The straight run in the ranks' own processes: the same bits as under torchrun.
    run_distributed(train_in_process, 2, straight, "debug", {"steps": 60})

    got, want = metrics(resumed), metrics(straight)
    assert [r["step"] for r in got] == list(range(61))  # step 0: the first evaluation
    assert [r["loss"] for r in got[41:]] == [r["loss"] for r in want[41:]]
    assert got[60]["val_loss"] == want[60]["val_loss"]
    for record in got[1:]:
        assert {"step", "loss", "lr", "tokens_per_s", "peak_mem_bytes"} <= record.keys()
        assert record["peak_mem_bytes"] > 0 and record["tokens_per_s"] > 0
    evaluated = [r["step"] for r in got if "val_loss" in r]
    assert evaluated == [0, 20, 40, 60]
    assert got[60]["val_loss"] < got[0]["val_loss"]

    assert _checkpoint_step(resumed) == 60
    kept = sorted(n for n in os.listdir(os.path.join(resumed, "checkpoints"))
                  if n.startswith("step_"))
    assert kept == ["step_000040", "step_000060"]  # checkpoint.keep = 2
    with open(os.path.join(resumed, "config.toml")) as f:
        assert "steps = 60\n" in f.read()
    with open(os.path.join(resumed, "loss.png"), "rb") as f:
        png = f.read()
    assert png.startswith(b"\x89PNG") and len(png) > 1000
    assert "--- sample after 60 steps ---" in second.stdout


@pytest.mark.slow
@pytest.mark.extended
def test_ctrl_c_saves_a_checkpoint_and_exits_cleanly(tmp_path):
    """Also: a second job started on the same --out while this one trains is refused at
    once, names the job that holds it and writes nothing; the lock goes with the job."""
    import fcntl

    out = str(tmp_path / "run")
    log = open(tmp_path / "stderr.txt", "w")
    launcher = subprocess.Popen(
        [sys.executable, "-m", "fullshard", "train", "--preset", "debug", "--steps", "100000",
         "--eval.every", "0", "--checkpoint.every", "0", "--out", out],
        env=ENV, stdout=subprocess.DEVNULL, stderr=log)
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while time.monotonic() < deadline and launcher.poll() is None:
            if os.path.exists(os.path.join(out, "metrics.jsonl")) and len(metrics(out)) > 5:
                break
            time.sleep(0.5)
        metrics_before = (tmp_path / "run" / "metrics.jsonl").read_text()
        second = _fullshard_train("--preset", "debug", "--steps", "3", "--out", out)
        with open(os.path.join(out, ".lock")) as f:
            holder = json.load(f)
        launcher.send_signal(signal.SIGINT)  # what Ctrl-C in a terminal sends
        code = launcher.wait(timeout=120)
    finally:
        if launcher.poll() is None:
            launcher.kill()
        log.close()
    stderr = (tmp_path / "stderr.txt").read_text()
    assert code == 130, stderr[-3000:]
    assert second.returncode == 2, second.stderr[-3000:]
    refusal = next(line for line in second.stderr.splitlines() if "another fullshard" in line)
    assert refusal.startswith(f"fullshard train: --out {out}: another fullshard train is "
                              f"writing this run (pid {holder['pid']} on {holder['host']}, "
                              f"job {holder['job']}, since "), refusal
    from support.catalogue import matches_documented
    assert matches_documented("E132", "ConfigError: " + refusal.removeprefix(
        "fullshard train: ")), refusal
    metrics_after = (tmp_path / "run" / "metrics.jsonl").read_text()
    assert metrics_after.startswith(metrics_before)  # the second job wrote nothing there
    assert [r["step"] for r in metrics(out)] == list(range(len(metrics(out))))
    with open(os.path.join(out, ".lock")) as f:  # released with the job's processes
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    stopped = metrics(out)[-1]["step"]
    assert 5 <= stopped < 100000
    assert f"stopped at step {stopped} on request" in stderr
    assert _checkpoint_step(out) == stopped
    assert "Traceback" not in stderr


@pytest.mark.parametrize("flags", [
    ["--preset", "debug", "--model", "hf:{llama}"],
    ["--preset", "debug", "--model", "hf:{llama}", "--lora.rank", "4"],
    ["--preset", "debug", "--gpt.n-layers", "1"],
], ids=["hf", "lora", "gpt-flags"])
def test_the_same_command_plus_resume_resumes(tmp_path, flags):
    """The README's recipe: the command that started a run, plus --resume, continues it;
    a --preset is compared as that command configures it, not as the bare preset."""
    from fullshard.cli.train import build_parser, resolve_config
    from fullshard.train.config.schema import to_toml

    llama = tmp_path / "llama"
    llama.mkdir()
    (llama / "config.json").write_text('{"model_type": "llama"}')
    flags = [f.format(llama=llama) for f in flags] + ["--out", str(tmp_path / "run")]
    started, out = resolve_config(build_parser().parse_args(flags))
    os.makedirs(out)
    with open(os.path.join(out, "config.toml"), "w") as f:  # as the run writes it
        f.write(to_toml(started))
    resumed, _ = resolve_config(build_parser().parse_args(flags + ["--resume"]))
    assert resumed == started


@pytest.mark.slow
@pytest.mark.extended
def test_a_resume_refuses_what_it_would_otherwise_ignore(tmp_path):
    """--resume continues the run's own config.toml: a --preset naming another model, or
    --steps below the checkpoint's step, is refused instead of ignored."""
    from support.catalogue import matches_documented

    out = str(tmp_path / "run")
    quick = ["--eval.every", "0", "--eval.sample-tokens", "0", "--out", out]
    first = _fullshard_train("--preset", "debug", "--steps", "4", *quick)
    assert first.returncode == 0, first.stderr[-3000:]
    other = _fullshard_train("--preset", "shakespeare", "--resume", *quick)
    assert other.returncode == 2, other.stderr[-3000:]
    line = other.stderr.strip().splitlines()[-1]
    assert matches_documented("E133", "ConfigError: " + line.removeprefix("fullshard train: ")), line
    fewer = _fullshard_train("--preset", "debug", "--steps", "2", "--resume", *quick)
    assert fewer.returncode == 2, fewer.stderr[-3000:]
    line = next(text for text in fewer.stderr.splitlines() if "steps: 2 is below" in text)
    assert matches_documented("E134", "ConfigError: " + line.removeprefix("fullshard train: ")), line
    assert _checkpoint_step(out) == 4 and [r["step"] for r in metrics(out)] == list(range(5))
