"""The error catalogue (docs/errors.md) as the tests read it: each entry's documented
text, whether a raised message is that text, and the message a call raises."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "errors.md"
_ENTRY = re.compile(r"^### (E\d+) [^\n]*\n(?:(?!^### ).)*?```text\n(.*?)\n```", re.S | re.M)


def documented() -> dict[str, str]:
    """Each catalogue code's documented text ("Type: message", "…" standing for any text)."""
    return {code: text.strip() for code, text in _ENTRY.findall(DOC.read_text())}


def _matches(doc_text: str, actual: str) -> bool:
    pattern = ".*?".join(re.escape(part) for part in doc_text.split("…"))
    return re.fullmatch(pattern, actual, re.S) is not None


def matches_documented(code: str, actual: str) -> bool:
    """Whether ``actual`` ("Type: message") is the text docs/errors.md gives for ``code``."""
    return _matches(documented()[code], actual)


def message_of(fn) -> str:
    """"Type: message" of what ``fn()`` raises, or "NO ERROR RAISED"."""
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - the point is to report whatever is raised
        return f"{type(err).__name__}: {err}"
    return "NO ERROR RAISED"


def run_stderr_of(*argv: str) -> str:
    """What ``python -m fullshard.run ARGV`` prints before running anything (in process)."""
    import fullshard
    from fullshard.run import main

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.suppress(SystemExit):
            main(list(argv))
    finally:
        fullshard.uninstall()
    return err.getvalue().strip()
