"""When torch's threaded process group can run fullshard here."""

import pytest

from fullshard.torch_version import VERSION

# torch 2.11's DTensor sharding propagation enters one FakeTensorMode from every thread
# that builds a DTensor, and crashes the process (a segmentation fault in
# fake_tensor.__enter__) when the ranks are threads; from torch 2.13 it does not.
NEEDS_THREAD_SAFE_DTENSOR = pytest.mark.skipif(
    VERSION < (2, 13), reason="torch 2.11 crashes building DTensors on several threads at once")
