"""Shared test set-up."""

import pathlib
import sys

# Tests in subfolders (tests/conformance) import helpers of tests/ by module name, e.g.
# ``from test_error_catalogue import matches_documented``.
sys.path.insert(0, str(pathlib.Path(__file__).parent))
