"""What ranks that failed on purpose report: the harness's report of a scenario run at
world size 2, and the error a rank's traceback in it ends with."""

import pytest

from fullshard.testing import run_distributed


def failure_report(scenario, *args) -> str:
    """The harness's report of the ranks that failed running ``scenario`` at world size 2."""
    with pytest.raises(AssertionError) as failure:
        run_distributed(scenario, 2, *args, timeout=120)
    return str(failure.value)


def first_error(report: str, error_type: str) -> str:
    """The first ``error_type: message`` a rank's traceback in ``report`` ends with."""
    start = report.index(error_type + ": ")
    end = report.find("\n\n--- rank", start)
    return report[start:end if end >= 0 else None].strip()
