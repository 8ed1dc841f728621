"""What the library refuses (projection/settings.py and the names it looks up): sizes
that are not positive, unknown devices, shapes and strategies."""

from __future__ import annotations

import math

import pytest

from fullshard.projection import (DEVICES, SHAPES, Cluster, ProjectionError, Settings,
                                  device_named, project, shape_named)

from support.catalogue import matches_documented


def test_library_sizes_must_be_positive():
    with pytest.raises(ProjectionError) as err:
        Settings(batch=0)
    assert matches_documented("E127", f"ProjectionError: {err.value}")


def test_an_unknown_attention_kernel_is_refused_by_name():
    with pytest.raises(ProjectionError) as err:
        Settings(attention="flash3")
    message = f"ProjectionError: {err.value}"
    assert matches_documented("E355", message) and "'flash3'" in message, message
    assert Settings(attention="flash1").attention == "flash1"


def test_an_unknown_compile_setting_is_refused_by_name():
    with pytest.raises(ProjectionError) as err:
        Settings(compile="inductor")
    message = f"ProjectionError: {err.value}"
    assert matches_documented("E381", message) and "'inductor'" in message, message
    assert "\n" not in message
    assert [Settings(compile=c).compile for c in ("none", "blocks", "model")] == [
        "none", "blocks", "model"]
    assert Settings().compile == "none"  # eager unless a run says otherwise


def test_library_errors():
    with pytest.raises(ProjectionError):
        device_named("tpu")
    with pytest.raises(ProjectionError):
        shape_named("nope")
    with pytest.raises(ProjectionError):
        Settings(strategy="zero4")
    assert math.isfinite(project(SHAPES["debug"], Cluster(DEVICES["h100"], 1, 8),
                                 Settings(seq=32)).mfu)
