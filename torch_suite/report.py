"""Summarize the suite's junit XML files: one row per test file (passed / failed /
skipped), and with ``--failures`` each failed test with the exception it ended on.

``python torch_suite/report.py DIR [--failures]``: DIR holds one ``<file>.xml`` per
test file (what ``torch_suite/run.py`` writes)."""

from __future__ import annotations

import pathlib
import re
import sys
import xml.etree.ElementTree as ET

_EXC = re.compile(r"^\s*(?:E\s+)?([A-Za-z_.]*(?:Error|Exception|Exit)): (.*)$")


def _reason(text: str) -> str:
    """The last exception line that is not the test base's "Thread/Process N exited"."""
    found = ""
    for line in text.splitlines():
        m = _EXC.match(line)
        if m and not re.match(r"(Thread|Process) \d+ exited", m.group(2)):
            found = f"{m.group(1)}: {m.group(2)}"
    return (found or text.strip().splitlines()[-1] if text.strip() else "")[:300]


def summarize(xml_path: pathlib.Path) -> tuple[dict[str, int], list[tuple[str, str]]]:
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    failures = []
    for case in ET.parse(xml_path).getroot().iter("testcase"):
        name = f"{case.get('classname', '').split('.')[-1]}.{case.get('name')}"
        bad = case.find("failure")
        if bad is None:
            bad = case.find("error")
        if bad is not None:
            counts["failed"] += 1
            failures.append((name, _reason((bad.get("message") or "") + "\n" + (bad.text or ""))))
        elif case.find("skipped") is not None:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    return counts, failures


def print_table(folder: pathlib.Path, failures: bool = False) -> int:
    """Print the per-file table (and each failure); return the number of failed tests."""
    total = {"passed": 0, "failed": 0, "skipped": 0}
    print("| file | passed | failed | skipped |\n|---|---|---|---|")
    rows = []
    for xml_path in sorted(folder.glob("*.xml")):
        counts, failed = summarize(xml_path)
        rows.append((xml_path.stem, failed))
        for k in total:
            total[k] += counts[k]
        print(f"| {xml_path.stem} | {counts['passed']} | {counts['failed']} | {counts['skipped']} |")
    print(f"| all | {total['passed']} | {total['failed']} | {total['skipped']} |")
    if failures:
        for stem, failed in rows:
            for name, why in failed:
                print(f"FAILED {stem}::{name}: {why}")
    return total["failed"]


def main(argv: list[str]) -> int:
    print_table(pathlib.Path(argv[0]), failures="--failures" in argv)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
