"""The pytest plugin the runner loads (``-p torch_suite_plugin``): marks the tests
``exclusions.py`` lists as skipped, with their reason. The patches themselves are
applied by sitecustomize.py when the interpreter starts (shim/torch_suite_shim.py)."""

import pytest

import torch_suite_shim
from exclusions import CPU, exclusion


def pytest_collection_modifyitems(config, items):
    for item in items:
        found = exclusion(item.nodeid)
        if found is None:
            continue
        kind, reason = found
        if kind == CPU or not torch_suite_shim.native():
            item.add_marker(pytest.mark.skip(reason=f"{kind}: {reason}"))
