"""``python -m fullshard.run script.py [args...]`` or ``python -m fullshard.run -m pkg.mod
[args...]``: run a program with torch's FSDP2 names resolved to fullshard
(:func:`fullshard.install`), unchanged otherwise. Works under ``torchrun``:
``torchrun --nproc_per_node 2 -m fullshard.run train.py``."""

from __future__ import annotations

import importlib.util
import os
import runpy
import sys

from .torch_names import install


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        sys.exit(0 if argv else 2)
    if argv[0] == "-m":
        if len(argv) < 2:
            _refuse("-m needs a module name: python -m fullshard.run -m package.module [args...]")
        install()  # first: finding a submodule imports its packages
        _check_module(argv[1])
        sys.argv = argv[1:]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        _check_program(argv[0])
        install()
        sys.argv = argv
        runpy.run_path(argv[0], run_name="__main__")


def _refuse(message: str) -> None:
    """One line on stderr and exit code 2, as Python does for a program it cannot open
    (the program's own errors keep their tracebacks: they are raised, not caught)."""
    print(f"fullshard.run: {message}", file=sys.stderr)
    sys.exit(2)


def _check_program(path: str) -> None:
    if os.path.isfile(path) or os.path.isfile(os.path.join(path, "__main__.py")):
        return
    why = ("a directory without __main__.py" if os.path.isdir(path) else "no such file")
    _refuse(f"can't open program {path!r}: {why}. Give the path of the program to run: "
            "python -m fullshard.run train.py [args...], or a module: -m package.module")


def _check_module(name: str) -> None:
    try:
        spec = importlib.util.find_spec(name)
        package = spec is not None and spec.submodule_search_locations is not None
        if package and importlib.util.find_spec(f"{name}.__main__") is None:
            _refuse(f"{name!r} is a package without a __main__ module, so it cannot be run; "
                    "give the module to run: python -m fullshard.run -m package.module "
                    "[args...]")
    except (ImportError, ValueError):  # a parent package that is missing, or a bad name
        spec = None
    if spec is None:
        _refuse(f"no module named {name!r} on sys.path; give an importable module: "
                "python -m fullshard.run -m package.module [args...], or a program's path")


if __name__ == "__main__":
    main()
