"""Shared test set-up and the lanes' markers.

``make test`` runs everything but the ``multinode``, ``soak``, ``extended`` and ``scale``
lanes (``scale``: world sizes 8 to 1,024 in one process, timed, so run alone by ``make
test-scale``);
``make test-fast`` also leaves out the tests marked ``@pytest.mark.slow`` (each over
~1.5 s: multi-rank training runs, the trainer end to end, checkpoints on disk, measured
memory) and runs in under 2 minutes. A new test is fast unless it carries the marker;
``pytest -m "not slow" --durations=20`` shows what to mark. ``@pytest.mark.extended``
marks what ``make test`` (under 10 minutes) has no time for: more combinations, the
benchmark scripts' CPU runs, estimates at scale, integrations (``make test-extended``,
run by CI).

It also keeps CUDA out of the CPU lane on machines that have a GPU (tests/lanes.py);
``make test-gpu`` runs the CUDA lane, tests/gpu.
"""

import os
import pathlib
import sys

import pytest

# The tests are laid out like the package (tests/core/test_group.py for
# src/fullshard/core/group.py, docs/architecture.md's Testing); they
# import what they share from tests/support, e.g. ``from support.catalogue import
# matches_documented``, and tests/lanes.py by module name.
sys.path.insert(0, str(pathlib.Path(__file__).parent))

import lanes  # noqa: E402 - found through the path set just above

# The CPU lane runs as on a machine without a GPU, whatever the machine (see tests/lanes.py).
# Done when this file is imported: before any test imports torch and asks CUDA anything.
if not lanes.is_cuda_lane(os.environ):
    lanes.hide_cuda(os.environ)


# The multi-node lane (2 launchers x 2 ranks each, ~3 minutes on 2 cores): left out of
# `make test` to keep it under 10 minutes, run by `make test-multinode`; CI runs both.
MULTINODE_FILES = ("tests/train/test_launch_multinode.py",)


# Files whose gloo ranks check every collective against NCCL's rules
# (fullshard.testing.nccl_rules: sizes, dtypes, ops and order alike on every rank; no
# device tensors in objects): the core parity tests, about +12% in time. A file whose
# ranks diverge on purpose (tests/core/test_guard_divergence.py, test_guard_arrival.py, the
# rank-dependent paths) stays out: the checker would refuse the divergence before the
# error the test checks. Proven only for these files; more join once they pass under it.
NCCL_RULES_FILES = ("tests/test_api.py", "tests/test_wrap.py",
                    "tests/core/test_mesh_hybrid.py", "tests/core/test_comm_collectives.py",
                    "tests/core/test_group.py", "tests/test_fullshard_feature_combinations.py",
                    "tests/whole_matrix/test_whole_matrix.py", "tests/train/test_scaler.py",
                    "tests/core/test_features_post_forward.py", "tests/core/test_features_quantized_collectives.py")


@pytest.fixture(autouse=True)
def _nccl_rules(request, monkeypatch):
    """FULLSHARD_NCCL_RULES=1 for the tests of NCCL_RULES_FILES (run_distributed reads it)."""
    if request.node.nodeid.startswith(NCCL_RULES_FILES):
        monkeypatch.setenv("FULLSHARD_NCCL_RULES", "1")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid.startswith(MULTINODE_FILES):
            item.add_marker(pytest.mark.multinode)


def pytest_configure(config):
    if not lanes.is_cuda_lane(os.environ) and lanes.cuda_was_already_initialized():
        raise pytest.UsageError(
            "tests/conftest.py: CUDA was initialized before the CPU lane could hide it (a "
            "plugin or conftest used torch.cuda first); run with CUDA_VISIBLE_DEVICES= set.")
    config.addinivalue_line("markers", "slow: over ~1.5 s; left out of `make test-fast`")
    config.addinivalue_line("markers", "soak: long runs, left out of `make test`; `make soak`")
    config.addinivalue_line("markers", "multinode: the multi-node lane, `make test-multinode`")
    config.addinivalue_line("markers", "scale: world sizes 8 to 1,024 in one process (torch's "
                                       "fake process group); `make test-scale`, not in "
                                       "`make test`")
    config.addinivalue_line("markers", "extended: what `make test` has no time for (more "
                                       "combinations, the benchmark scripts' CPU runs, "
                                       "estimates at scale, integrations); `make test-extended`")
