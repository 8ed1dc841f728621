"""benchmarks/offload.py's paths train alike: fullshard with CPU offload (stepped as the
trainer steps, the clip inside fused AdamW, OverlappedStep), torch FSDP2 with its
CPUOffloadPolicy, and fullshard without offload give FSDP2's losses, so the side-by-side
comparison keeps comparing the same work."""

import importlib.util
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import offload as bench  # noqa: E402  (benchmarks/offload.py)


def test_fullshard_and_plain_train_to_fsdp2s_losses():
    # a large rate, so that a step that clips or updates differently moves the last loss
    # by more than the tolerance (AdamW's first update does not see a clip coefficient)
    results = {impl: bench.launch(impl, "tiny", 0, 3, lr=0.05)
               for impl in ("fullshard", "fsdp2", "plain")}
    for r in results.values():
        assert len(r["losses"]) == 3 and len(r["times"]) == 3 and len(r["phases"]) == 3
    # the second loss moved: the step changed the weights (a skipped step would agree too)
    assert results["fsdp2"]["losses"][0] != results["fsdp2"]["losses"][1]
    for impl, worst in bench.compare(results).items():
        assert worst <= bench.TOLERANCE, (impl, results[impl]["losses"], results["fsdp2"]["losses"])


def test_deepspeed_column_is_skipped_with_a_reason_where_it_is_missing():
    if importlib.util.find_spec("deepspeed") is not None:
        pytest.skip("deepspeed is installed here")
    python, why = bench._deepspeed_python(None)
    assert python is None and "--deepspeed-python" in why
    assert bench._deepspeed_python("/some/python") == ("/some/python", "")
