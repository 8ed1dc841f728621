"""Imported by every Python process of the suite (the runner puts this folder on
PYTHONPATH): the spawned ranks get the same patches as the pytest process."""

import os

if os.environ.get("FULLSHARD_TORCH_SUITE") == "1":
    import torch_suite_shim

    torch_suite_shim.apply()
