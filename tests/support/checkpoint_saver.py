"""A process that saves checkpoints for ever, for the kill -9 trials of
tests/checkpoint/test_io_faults.py.

    python tests/support/checkpoint_saver.py DIR

It imports torch and saves once (printing ``ready SECONDS``, the save's time), then for
each line ``go`` on stdin forks a child that saves
``DIR/step_N`` (N counting on from ``latest``) again and again as ``fullshard train``
does (keeping the two newest), prints the child's pid, and prints ``reaped`` once the
test has killed it. Step N's weights are ``weights(N)``, so any checkpoint's content can
be checked against its name.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
import warnings

import torch
import torch.nn as nn

from fullshard import checkpoint
from fullshard.train.checkpoints import _prune as prune

KEEP = 2


def model_for(step: int) -> nn.Module:
    torch.manual_seed(step)
    return nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256), nn.Linear(256, 256))


def _save_forever(directory: str) -> None:
    latest = os.path.join(directory, "latest")
    step = int(open(latest).read().strip()[len("step_"):]) if os.path.isfile(latest) else 0
    while True:
        step += 1
        checkpoint.save(os.path.join(directory, f"step_{step:06d}"), model_for(step),
                        extra={"step": step})
        prune(directory, KEEP)  # as the trainer deletes old checkpoints


def main(directory: str) -> None:
    warnings.simplefilter("ignore")  # DCP: "assuming the intent is to save in a single process"
    os.makedirs(directory, exist_ok=True)
    with tempfile.TemporaryDirectory() as warm:  # every lazy import done before forking
        checkpoint.save(os.path.join(warm, "step_000000"), model_for(0))
        start = time.perf_counter()  # a warm save's time
        checkpoint.save(os.path.join(warm, "step_000001"), model_for(1))
        print(f"ready {time.perf_counter() - start:.4f}", flush=True)
    for line in sys.stdin:
        if line.strip() != "go":
            break
        pid = os.fork()
        if pid == 0:
            try:
                _save_forever(directory)
            finally:
                os._exit(1)
        print(pid, flush=True)
        os.waitpid(pid, 0)
        print("reaped", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
