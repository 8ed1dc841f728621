"""CUDA lane: ``fullshard train`` on NCCL, one rank per GPU, stopped and resumed."""

import lanes

lanes.require_cuda_lane()

import json  # noqa: E402 - only once the lane is known to run
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

from fullshard.testing import visible_gpus  # noqa: E402

WORLD = visible_gpus()
TIMEOUT_S = 300


def _train(out, steps, *extra):
    done = subprocess.run(
        [sys.executable, "-m", "fullshard", "train", "--preset", "debug", "--nproc",
         str(WORLD), "--steps", str(steps), "--eval.every", "10", "--out", out, *extra],
        env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
        timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def _metrics(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_a_short_run_on_nccl_resumes_like_a_straight_one(tmp_path):
    resumed, straight = str(tmp_path / "resumed"), str(tmp_path / "straight")
    first = _train(resumed, 10)
    assert f"over {WORLD} cuda ranks" in first.stderr + first.stdout
    second = _train(resumed, 20, "--resume")
    assert "resuming at step 10" in second.stderr
    _train(straight, 20)
    got, want = _metrics(resumed), _metrics(straight)
    assert [r["step"] for r in got] == list(range(21))
    for a, b in zip(got[11:], want[11:]):
        # the same kernels on the same data; embedding backward's atomic adds may reorder
        # its sums, hence close rather than equal
        assert abs(a["loss"] - b["loss"]) <= 1e-4 * abs(b["loss"]), (a, b)
        assert a["peak_mem_bytes"] > 0
    assert got[20]["val_loss"] < got[0]["val_loss"]
