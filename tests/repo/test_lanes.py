"""The CPU lane runs as on a machine without a GPU; the CUDA lane says why it cannot run.

On a CPU-only machine the pinning checks below hold either way; on a machine with a GPU
they are what keeps the CPU tests (CPU references, gloo ranks, the trainer on gloo, the
CPU error texts) from picking the GPU up.
"""

import os
import subprocess
import sys

import pytest
import torch

import lanes
from fullshard.testing import rank_device, run_distributed, visible_gpus
from fullshard.testing.harness import _context

CPU_LANE = not lanes.is_cuda_lane(os.environ)


def test_the_cuda_lane_names_why_it_is_skipped():
    asked = []

    def devices(n):
        return lambda: asked.append(n) or n

    reason = lanes.cuda_lane_skip_reason({}, devices(1))
    assert "make test-gpu" in reason and "FULLSHARD_TEST_LANE=cuda" in reason
    assert asked == []  # the CPU lane does not ask CUDA anything
    assert lanes.cuda_lane_skip_reason({"FULLSHARD_TEST_LANE": "cuda"}, devices(0)) == \
        "the CUDA lane needs a CUDA GPU: torch sees none here"
    assert lanes.cuda_lane_skip_reason({"FULLSHARD_TEST_LANE": "cuda"}, devices(2)) is None
    assert lanes.cuda_lane_skip_reason({"FULLSHARD_TEST_LANE": "cpu"}, devices(2)) is not None


def test_hiding_cuda_empties_the_visible_devices():
    environ = {"CUDA_VISIBLE_DEVICES": "0,1"}
    lanes.hide_cuda(environ)
    assert environ == {"CUDA_VISIBLE_DEVICES": ""}


def _what_a_rank_sees():
    from fullshard.memory.tracker import MemoryTracker

    return {"CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "cuda": torch.cuda.is_available(), "device": str(rank_device()),
            "tracker": MemoryTracker().device.type}


@pytest.mark.skipif(not CPU_LANE, reason="checks the CPU lane")
@pytest.mark.slow
def test_the_cpu_lane_hides_cuda_from_tests_ranks_and_subprocesses():
    from fullshard.fsdp1.mesh import ranks_per_node
    from fullshard.memory.tracker import MemoryTracker
    from fullshard.train.launch.launcher import default_nproc

    assert os.environ["CUDA_VISIBLE_DEVICES"] == ""
    assert not torch.cuda.is_available() and visible_gpus() == 0
    # fullshard's own device choices, as on a machine without CUDA
    assert default_nproc() == 2  # the trainer: two gloo ranks, not one NCCL rank per GPU
    assert MemoryTracker().device.type == "cpu"
    os.environ.pop("LOCAL_WORLD_SIZE", None)
    assert ranks_per_node(4) == 4  # HYBRID_SHARD: one node of every rank, not of the GPUs
    assert rank_device() == torch.device("cpu")
    for seen in run_distributed(_what_a_rank_sees, 2):
        assert seen == {"CUDA_VISIBLE_DEVICES": "", "cuda": False, "device": "cpu",
                        "tracker": "cpu"}
    # the trainer's workers are subprocesses: they inherit the setting
    out = subprocess.run([sys.executable, "-c", "import os; print(repr(os.environ.get("
                          "'CUDA_VISIBLE_DEVICES')))"], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "''"


def test_nccl_ranks_need_a_gpu_each_and_are_told_before_any_starts():
    with pytest.raises(ValueError, match=r"each of the world_size=\d+ ranks on a GPU of its "
                                         r"own, but \d+ GPUs? (is|are) visible.*'gloo'"):
        run_distributed(_what_a_rank_sees, visible_gpus() + 1, backend="nccl")


def test_nccl_ranks_are_spawned_not_forked():
    # A child forked from a process that touched the CUDA driver cannot use CUDA.
    assert _context("nccl").get_start_method() == "spawn"
    assert _context("gloo").get_start_method() == "forkserver"
