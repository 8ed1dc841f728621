"""The progress line (train/report/progress.py): one line per step into a file or pipe, one
line rewritten in place on a terminal."""

import io
import re

from fullshard.train.report.progress import ProgressLine


def _progress(stream, steps=range(41, 45)):
    line = ProgressLine(steps[0], 60, stream)
    for step in steps:
        line.update(step, 2.5, 12345.6, 3 * 2**20)
        if step == 42:
            line.message("step 42: val loss 2.1000")
    line.close()
    return stream.getvalue()


def test_progress_is_one_line_per_step_off_a_terminal():
    lines = _progress(io.StringIO()).splitlines()
    assert len(lines) == 5 and lines[2] == "step 42: val loss 2.1000"
    assert re.fullmatch(r"step 41/60  loss 2\.5000  12,346 tok/s  peak/rank max 3 MiB  "
                        r"elapsed 00:00  eta \d\d:\d\d", lines[0]), lines[0]
    assert [int(line.split()[1].split("/")[0]) for line in lines if "tok/s" in line] == \
        [41, 42, 43, 44]
    assert "\r" not in "".join(lines)


def test_progress_rewrites_one_line_on_a_terminal():
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    text = _progress(Terminal())
    assert "\r" in text and "step 42: val loss 2.1000\n" in text
    assert text.rstrip("\n").split("\r")[-1].startswith("step 44/60  loss 2.5000")
