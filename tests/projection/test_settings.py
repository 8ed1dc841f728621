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


@pytest.mark.parametrize("field, bad, code, names", [
    ("attention", "flash3", "E355", ("flash2", "flash1")),
    ("compile", "inductor", "E381", ("none", "blocks", "model")),
    ("kernels", "liger", "E388", ("eager", "fused")),
])
def test_an_unknown_kernel_setting_is_refused_by_name(field, bad, code, names):
    with pytest.raises(ProjectionError) as err:
        Settings(**{field: bad})
    message = f"ProjectionError: {err.value}"
    assert matches_documented(code, message) and repr(bad) in message, message
    assert "\n" not in message
    assert [getattr(Settings(**{field: n}), field) for n in names] == list(names)
    # the first name is the default: flash attention 2, eager, PyTorch's own kernels
    assert getattr(Settings(), field) == names[0]


def test_hand_fused_kernels_fuse_the_blocks_as_compiling_them_does_and_once():
    assert [Settings(kernels=k, compile=c).fused_blocks
            for k, c in (("eager", "none"), ("fused", "none"), ("eager", "blocks"),
                         ("fused", "model"))] == [False, True, True, True]


def test_library_errors():
    with pytest.raises(ProjectionError):
        device_named("tpu")
    with pytest.raises(ProjectionError):
        shape_named("nope")
    with pytest.raises(ProjectionError):
        Settings(strategy="zero4")
    assert math.isfinite(project(SHAPES["debug"], Cluster(DEVICES["h100"], 1, 8),
                                 Settings(seq=32)).mfu)
