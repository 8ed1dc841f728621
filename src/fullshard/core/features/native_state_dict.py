"""Which form ``state_dict()`` takes: DTensor shards, or a front's own conversion.

A sharded module's ``state_dict()`` natively holds DTensor shards. The FSDP1 front
converts them (to full tensors by default) at the *outermost* ``state_dict()`` /
``load_state_dict()`` call. Code that needs the shards whatever front built the model
(fullshard's checkpoint functions, DCP) runs inside :func:`native_state_dict`; the
front's own recursion into submodules is inside it too. The switch lives here, below
both, so neither imports the other for it.
"""

from __future__ import annotations

import contextlib
import threading

# Per thread: .value > 0 inside an outermost conversion or native_state_dict. A state-dict
# call nests through torch's module hooks, which cannot carry an argument down.
_DEPTH = threading.local()


@contextlib.contextmanager
def native_state_dict():
    """Inside, ``state_dict()``/``load_state_dict()`` of every sharded module use DTensors."""
    _DEPTH.value = getattr(_DEPTH, "value", 0) + 1
    try:
        yield
    finally:
        _DEPTH.value -= 1


def is_outermost() -> bool:
    """Whether no conversion or native section is running on this thread."""
    return getattr(_DEPTH, "value", 0) == 0
