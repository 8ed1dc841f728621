"""Every number every fullshard command reads, given anything (Hypothesis): the real
``main()`` either succeeds with sane output or says one line and exits 2.

``fullshard train`` is run up to its launch (torchrun is replaced by a recorder: nothing
trains); ``estimate`` and ``plan`` run whole, on the debug preset's small model.
"""

from __future__ import annotations

import contextlib
import io
import math
from unittest import mock

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from fullshard.cli import main
from fullshard.cli import train as train_cli
from fullshard.train.config.schema import GPT_BOUNDS, TrainConfig, sections, scalar_fields

LAUNCH_NUMBERS = ["--nproc", "--nnodes", "--node-rank", "--master-port", "--join-timeout",
                  "--max-restarts"]
TRAIN_NUMBERS = LAUNCH_NUMBERS + [
    f"--{prefix}{f.name}" for prefix, obj in sections(TrainConfig())
    for f in scalar_fields(obj)
    if "bounds" in f.metadata or (prefix == "gpt." and f.name in GPT_BOUNDS)
] + ["--parallel.reshard_after_forward"]
MODEL_NUMBERS = ["--world-size", "--batch", "--seq", "--baseline-mib"]
ESTIMATE_NUMBERS = MODEL_NUMBERS + ["--reshard-after-forward", "--params"]
PLAN_NUMBERS = MODEL_NUMBERS + ["--budget-gib", "--margin"]

_floats = st.floats(allow_nan=True, allow_infinity=True)
# What a person (or a script) might type where a number belongs.
VALUES = st.one_of(
    st.integers(-3, 70).map(str),
    st.integers().map(str),
    st.integers(2 ** 20, 2 ** 70).map(str),
    _floats.map(repr),
    _floats.map(str),
    st.sampled_from(["", "nan", "NaN", "inf", "-inf", "1e3", "0x10", " 7 ", "1_000", "2.0",
                     "-0", "true", "auto", "１", "--", "=", "7e400"]),
    st.text(max_size=12),
)


def _flags(names: list[str]) -> st.SearchStrategy[list[str]]:
    """One to three (flag, value) pairs, as ``--flag=value`` (a value may start with -)."""
    pair = st.tuples(st.sampled_from(names), VALUES).map(lambda p: f"{p[0]}={p[1]}")
    return st.lists(pair, min_size=1, max_size=3)


def _run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exit_:  # argparse's one-line refusals
            code = exit_.code
    return code, out.getvalue(), err.getvalue()


def _assert_one_line_refusal(code: int, err: str, argv: list[str]) -> None:
    assert code == 2, (argv, code, err)
    assert err.count("\n") == 1 and err.endswith("\n"), (argv, err)
    assert "Traceback" not in err, (argv, err)


def _settings(examples: int) -> settings:
    """Derandomized (the same cases every run) and without deadlines: each case runs
    the whole command."""
    return settings(max_examples=examples, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow,
                                           HealthCheck.function_scoped_fixture])
COUNTS: dict[str, list[int]] = {}  # command -> [cases, accepted]


def _count(command: str, accepted: bool) -> None:
    cases = COUNTS.setdefault(command, [0, 0])
    cases[0] += 1
    cases[1] += accepted


@_settings(130)
@given(flags=_flags(TRAIN_NUMBERS))
@example(flags=["--gpt.n_heads=0"])  # once a ZeroDivisionError in GPTConfig
@pytest.mark.slow
def test_train_numbers_are_accepted_or_refused_in_one_line(flags, tmp_path_factory):
    launches = []
    out = str(tmp_path_factory.getbasetemp() / "train_numbers")
    argv = ["train", "--preset", "debug", "--out", out, *flags]
    with mock.patch.object(train_cli, "launch", lambda options, run_argv: launches.append(
            (options, run_argv)) or 0):
        code, _, err = _run(argv)
    _count("train", code == 0)
    if code == 0:
        assert err == "" and len(launches) == 1, (argv, err)
        cfg, _ = train_cli.resolve_config(train_cli.build_parser().parse_args(
            launches[0][1]))
        for prefix, obj in sections(cfg):
            for f in scalar_fields(obj):
                value = getattr(obj, f.name)
                if isinstance(value, float):
                    assert math.isfinite(value), (argv, f.name)
    else:
        _assert_one_line_refusal(code, err, argv)
        assert not launches


@_settings(80)
@given(flags=_flags(ESTIMATE_NUMBERS))
@pytest.mark.slow
def test_estimate_numbers_are_accepted_or_refused_in_one_line(flags):
    argv = ["estimate", "--preset", "debug", "--world-size", "4", *flags]
    if any(f.startswith("--params=") for f in flags):
        argv.append("--zero-table")
    code, out, err = _run(argv)
    _count("estimate", code == 0)
    if code == 0:
        assert err == "" and ("peak per rank" in out or "ZeRO" in out or "stage" in out), \
            (argv, out)
        assert "nan" not in out.lower() and "inf " not in out.lower(), (argv, out)
    else:
        _assert_one_line_refusal(code, err, argv)


@_settings(45)
@given(flags=_flags(PLAN_NUMBERS))
@pytest.mark.slow
def test_plan_numbers_are_accepted_or_refused_in_one_line(flags):
    argv = ["plan", "--preset", "debug", "--world-size", "4", "--budget-gib", "1", *flags]
    code, out, err = _run(argv)
    _count("plan", code in (0, 1) and not err)
    if code in (0, 1) and not err:  # 1: nothing fits the budget, and the plan says why
        assert out.startswith("chosen:" if code == 0 else "nothing fits in"), (argv, out)
        assert "nan" not in out.lower(), (argv, out)
    else:
        _assert_one_line_refusal(code, err, argv)


@pytest.fixture(scope="module", autouse=True)
def _report_counts():
    yield
    for command, (cases, accepted) in COUNTS.items():
        print(f"\n{command}: {cases} cases, {accepted} accepted, {cases - accepted} refused "
              "in one line")
