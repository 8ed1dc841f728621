"""Fault suite for every reader of a checkpoint (load, inspect, export, export --hf):
random byte flips, truncations and deletions across a saved checkpoint's files, and
kill -9 at random points of a save.

Property: a reader either refuses with a one-line CheckpointError naming the checkpoint's
file or directory, or returns exactly what it returns for the undamaged checkpoint; never
other weights, never another exception. The case counts are set by
FULLSHARD_FAULT_CASES (damage cases per world size, default 200) and
FULLSHARD_KILL_TRIALS (default 30); each test prints what it tried.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from fullshard import checkpoint
from fullshard.checkpoint import CheckpointError, Kind, classify
from fullshard.checkpoint.export import export_safetensors, inspect
from fullshard.testing import run_distributed

hypothesis = pytest.importorskip("hypothesis")
safetensors_torch = pytest.importorskip("safetensors.torch")
pytest.importorskip("transformers")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

CASES = int(os.environ.get("FULLSHARD_FAULT_CASES", "200"))
KILL_TRIALS = int(os.environ.get("FULLSHARD_KILL_TRIALS", "30"))
STEP = "step_000001"


def _config():
    from fullshard.train.config.schema import get_preset
    return get_preset("debug")


def _fresh_model():
    from fullshard.train.model import build_model
    torch.manual_seed(1)
    return build_model(_config().gpt)


def _save_run(out: str) -> None:
    """OUT/config.toml and OUT/checkpoints/step_000001 of the debug GPT, saved at the
    world size this runs at (the weights are the same at every world size)."""
    from fullshard import fully_shard
    from fullshard.train.config.schema import to_toml

    model = _fresh_model()
    if dist.is_initialized():
        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
    if not dist.is_initialized() or dist.get_rank() == 0:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "config.toml"), "w") as f:
            f.write(to_toml(_config()))
    checkpoint.save(os.path.join(out, "checkpoints", STEP), model, extra={"step": 1})


def _safetensors_in(folder: str) -> dict[str, torch.Tensor]:
    tensors = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            tensors.update(safetensors_torch.load_file(os.path.join(folder, name)))
    return tensors


def _readers(run: str, scratch: str) -> dict:
    """Each reader of the checkpoint in ``run``, as a function returning what it read."""
    from fullshard.train.export.hf import export_hf

    step = os.path.join(run, "checkpoints", STEP)

    def load():
        model = _fresh_model()
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        extra = checkpoint.load(step, model)
        return extra, {k: v.clone() for k, v in model.state_dict().items()}

    def inspected():
        info = inspect(step)
        if info["failed"]:
            raise CheckpointError(info["checksums"])  # refused, as the CLI's exit code 1
        return {k: v for k, v in info.items() if k != "path"}

    def export():
        out = os.path.join(scratch, "model.safetensors")
        export_safetensors(step, out)
        return safetensors_torch.load_file(out)

    def export_hugging_face():
        out = os.path.join(scratch, "hf")
        export_hf(run, out, 10**9)
        return _safetensors_in(out)

    return {"load": load, "inspect": inspected, "export": export,
            "export --hf": export_hugging_face}


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k])
                                                                     for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return a == b


@pytest.fixture(scope="module", params=[pytest.param(1, marks=pytest.mark.extended), 2],
                ids=["world1", "world2"])
def saved(request, tmp_path_factory):
    """A saved run (once per world size) and what each reader returns from it intact."""
    root = tmp_path_factory.mktemp(f"faults{request.param}")
    run = str(root / "run")
    if request.param == 1:
        _save_run(run)
    else:
        run_distributed(_save_run, 2, run)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        intact = {name: read() for name, read in _readers(run, str(root)).items()}
    files = sorted(os.listdir(os.path.join(run, "checkpoints", STEP)))
    return run, intact, files, request.param


FAULT = st.tuples(st.integers(0, 99),  # which file (modulo their number)
                  st.sampled_from(["flip", "truncate", "delete"]),
                  st.floats(0, 1, allow_nan=False), st.integers(1, 255))


def _damage(step: str, files: list[str], faults) -> list[str]:
    done = []
    for which, kind, at, mask in faults:
        name = files[which % len(files)]
        path = os.path.join(step, name)
        if not os.path.exists(path):
            continue
        size = os.path.getsize(path)
        if kind == "delete":
            os.remove(path)
        elif kind == "truncate":
            with open(path, "r+b") as f:
                f.truncate(int(at * size))
        elif size:
            with open(path, "r+b") as f:
                f.seek(min(int(at * size), size - 1))
                byte = f.read(1)[0]
                f.seek(-1, os.SEEK_CUR)
                f.write(bytes([byte ^ mask]))
        done.append(f"{kind} {name}@{at:.3f}")
    return done


@pytest.mark.slow
def test_damaged_checkpoints_are_refused_by_name_or_read_exactly(saved):
    run, intact, files, world = saved
    outcomes: Counter = Counter()

    @settings(max_examples=CASES, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(st.lists(FAULT, min_size=1, max_size=3))
    def case(faults):
        with tempfile.TemporaryDirectory(prefix="fullshard-fault-") as scratch:
            copy = os.path.join(scratch, "run")
            shutil.copytree(run, copy)
            step = os.path.join(copy, "checkpoints", STEP)
            damage = _damage(step, files, faults)
            outcomes["cases"] += 1
            for name, read in _readers(copy, scratch).items():
                try:
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore", UserWarning)
                        result = read()
                except CheckpointError as err:
                    message = str(err)
                    assert "\n" not in message and step in message, (name, damage, message)
                    outcomes[f"{name} refused"] += 1
                    continue
                assert _same(result, intact[name]), (name, damage, "read other content")
                outcomes[f"{name} read exactly"] += 1

    case()
    print(f"\nworld size {world}: {dict(outcomes)}")
    assert outcomes["cases"] == CASES
    assert sum(v for k, v in outcomes.items() if k.endswith("refused")) > 0


@pytest.mark.slow
def test_kill_9_during_saves_leaves_the_latest_checkpoint_loadable(tmp_path):
    from support.checkpoint_saver import model_for

    directory = tmp_path / "checkpoints"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(Path(checkpoint.__file__).parents[2]), os.environ.get("PYTHONPATH", "")])}
    saver = subprocess.Popen([sys.executable, str(Path(__file__).parents[1] / "support" / "checkpoint_saver.py"),
                              str(directory)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True, env=env)
    rng = random.Random(os.environ.get("FULLSHARD_KILL_SEED", "0"))
    seen: Counter = Counter()
    try:
        ready, save_s = saver.stdout.readline().split()
        assert ready == "ready"
        for trial in range(KILL_TRIALS):
            saver.stdin.write("go\n")
            saver.stdin.flush()
            pid = int(saver.stdout.readline())
            if trial == 0:  # let the first save commit, so that every trial has a latest
                _wait_for(directory / "latest")
            # anywhere within the next few saves: before, inside and after the commit
            time.sleep(rng.uniform(0.0, 3 * float(save_s)))
            os.kill(pid, signal.SIGKILL)
            assert saver.stdout.readline().strip() == "reaped"
            seen["trials"] += 1
            names = os.listdir(directory)
            seen["left an unfinished save"] += any(n.endswith(".tmp") for n in names)
            latest = checkpoint.resolve(str(directory))
            model = model_for(0)
            extra = checkpoint.load(latest, model)  # verifies every file first
            assert os.path.basename(latest) == f"step_{extra['step']:06d}"
            expected = model_for(extra["step"])
            assert all(torch.equal(a, b) for a, b in zip(model.parameters(),
                                                         expected.parameters()))
            # only steps and `latest` in sight: whatever else a save, a rewrite of
            # `latest` or a prune left is hidden
            assert all(n == "latest" or n.startswith((".", "step_"))
                       for n in names), names
            for name in names:  # every committed step (the newest may be ahead of latest)
                if name.startswith("step_"):
                    assert classify(str(directory / name)) is Kind.FULLSHARD, name
                    checkpoint.open_checkpoint(str(directory / name))
            seen["latest loaded and verified"] += 1
    finally:
        saver.stdin.close()
        saver.kill()
        saver.wait()
    print(f"\nkill -9 trials (one save took {float(save_s) * 1000:.0f} ms): {dict(seen)}")
    assert seen["latest loaded and verified"] == KILL_TRIALS


def _wait_for(path: Path, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"no save committed {path} in {timeout} s"
        time.sleep(0.01)
