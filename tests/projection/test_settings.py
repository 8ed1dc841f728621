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


def test_library_errors():
    with pytest.raises(ProjectionError):
        device_named("tpu")
    with pytest.raises(ProjectionError):
        shape_named("nope")
    with pytest.raises(ProjectionError):
        Settings(strategy="zero4")
    assert math.isfinite(project(SHAPES["debug"], Cluster(DEVICES["h100"], 1, 8),
                                 Settings(seq=32)).mfu)
