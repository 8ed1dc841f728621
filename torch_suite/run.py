"""``make test-torch-suite``: PyTorch's own FSDP2 tests, run against fullshard.

The tests are torch's files, unchanged, from ``test/distributed/_composable/fsdp/`` in
PyTorch's repository at the commits ``MANIFEST`` names; they are not part of this
repository (third-party code) and are read from ``torch_suite/upstream/`` (or
``FULLSHARD_TORCH_SUITE_DIR``), each checked against its SHA-256 in ``MANIFEST``.
Every file runs in a pytest process of its own with ``shim/`` on ``PYTHONPATH``: torch's
test bases start CPU ranks over gloo instead of skipping for lack of GPUs, and torch's
FSDP2 names resolve to fullshard (``fullshard.install()``). ``--native`` runs the same
tests on torch's own FSDP2 (the control). ``exclusions.py`` lists what is skipped, why.

    python torch_suite/run.py [--native] [--out DIR] [FILE ...]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import pathlib
import subprocess
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import report  # noqa: E402 - found through the path set just above


# torch's test bases time out a hung test after 300 s; a whole file gets this long.
FILE_TIMEOUT_S = 1800


def manifest() -> dict[str, tuple[str, str]]:
    """File name -> (sha256, the PyTorch commit it is taken from), from MANIFEST."""
    files = {}
    for line in (HERE / "MANIFEST").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            digest, name, commit = line.split()
            files[name] = (digest, commit)
    return files


def check_files(folder: pathlib.Path, names: list[str], files: dict) -> list[str]:
    """The problems with the test files in ``folder`` (missing, or not torch's bytes)."""
    problems = []
    for name in names:
        path = folder / name
        digest, commit = files[name]
        if not path.exists():
            problems.append(f"{name} is missing (PyTorch commit {commit})")
        elif hashlib.sha256(path.read_bytes()).hexdigest() != digest:
            problems.append(f"{name} differs from PyTorch's file at commit {commit}")
    return problems


def run_file(folder: pathlib.Path, name: str, out: pathlib.Path, native: bool) -> float:
    env = dict(os.environ, FULLSHARD_TORCH_SUITE="1", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(HERE / "shim"),
                                                        os.environ.get("PYTHONPATH")])))
    if native:
        env["FULLSHARD_TORCH_SUITE_NATIVE"] = "1"
    stem = pathlib.Path(name).stem
    start = time.monotonic()
    with open(out / f"{stem}.log", "w") as log:  # pytest's own output, for the failures
        try:
            subprocess.run([sys.executable, "-m", "pytest", str(folder / name), "-q", "-p",
                            "no:cacheprovider", "-p", "torch_suite_plugin", "--rootdir",
                            str(folder), "-c", os.devnull, "-o", "junit_family=xunit1",
                            f"--junitxml={out / (stem + '.xml')}"],
                           env=env, stdout=log, stderr=subprocess.STDOUT, check=False,
                           timeout=FILE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            print(f"{name}: stopped after {FILE_TIMEOUT_S} s", file=log)
    return time.monotonic() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="*", help="test files (default: all in MANIFEST)")
    parser.add_argument("--native", action="store_true", help="torch's own FSDP2 (control)")
    parser.add_argument("--out", help="folder for the junit XML files (default: a temp dir)")
    args = parser.parse_args(argv)
    files = manifest()
    names = [pathlib.Path(n).name for n in args.files] or sorted(files)
    folder = pathlib.Path(os.environ.get("FULLSHARD_TORCH_SUITE_DIR", HERE / "upstream"))
    problems = check_files(folder, names, files)
    if problems:
        print(f"torch_suite: in {folder}: " + "; ".join(problems) + ". Copy each from "
              "test/distributed/_composable/fsdp/ in PyTorch's repository at that commit.",
              file=sys.stderr)
        return 2
    out = pathlib.Path(args.out or tempfile.mkdtemp(prefix="torch-suite-"))
    out.mkdir(parents=True, exist_ok=True)
    total = 0.0
    for name in names:
        seconds = run_file(folder, name, out, args.native)
        total += seconds
        print(f"{name}: {seconds:.0f} s (pytest's output: {out / pathlib.Path(name).stem}.log)",
              flush=True)
    print(f"wall time: {total:.0f} s ({'torch FSDP2' if args.native else 'fullshard'})")
    failed = report.print_table(out, failures=True)
    no_result = [n for n in names if not (out / f"{pathlib.Path(n).stem}.xml").exists()]
    for name in no_result:
        print(f"NO RESULT {name}: see {out / pathlib.Path(name).stem}.log")
    return 1 if failed or no_result else 0


if __name__ == "__main__":
    sys.exit(main())
