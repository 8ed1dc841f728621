"""The hidden names of what is in flight beside checkpoints (checkpoint/layout.py)."""

import os

import pytest

from fullshard.checkpoint.layout import (being_deleted, being_rewritten, being_written,
                                         is_leftover, set_aside)
from fullshard.checkpoint.verify import Kind, classify


@pytest.mark.parametrize("build,state", [(being_written, "tmp"), (set_aside, "replaced"),
                                         (being_deleted, "deleting"),
                                         (being_rewritten, "partial")])
def test_everything_in_flight_is_a_hidden_sibling_that_is_leftover_tells(build, state):
    path = os.path.join("run", "checkpoints", "step_000100")
    name = build(path)
    assert os.path.dirname(name) == os.path.dirname(path)
    assert os.path.basename(name).startswith(".step_000100")
    assert is_leftover(os.path.basename(name))
    assert is_leftover(os.path.basename(name), state)
    others = {"tmp", "replaced", "deleting", "partial"} - {state}
    assert not any(is_leftover(os.path.basename(name), other) for other in others)


@pytest.mark.parametrize("name", ["step_000100", "latest", "fullshard.json", ".metadata",
                                  "step_000100.tmp", ".step_000100", ".tmp"])
def test_visible_and_unrelated_names_are_not_leftovers(name):
    assert not is_leftover(name)


def test_a_manifest_left_half_written_marks_a_save_that_did_not_finish(tmp_path):
    for k, partial in enumerate((os.path.basename(being_rewritten("fullshard.json")),
                                 "fullshard.json.partial")):  # as older versions named it
        directory = tmp_path / f"step_00000{k}"
        directory.mkdir()
        (directory / ".metadata").write_bytes(b"")
        (directory / partial).write_text("{")
        assert classify(str(directory)) is Kind.UNFINISHED
