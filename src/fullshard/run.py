"""``python -m fullshard.run script.py [args...]`` or ``python -m fullshard.run -m pkg.mod
[args...]``: run a program with torch's FSDP2 names resolved to fullshard
(:func:`fullshard.install`), unchanged otherwise. Works under ``torchrun``:
``torchrun --nproc_per_node 2 -m fullshard.run train.py``."""

from __future__ import annotations

import runpy
import sys

from .torch_names import install


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        sys.exit(0 if argv else 2)
    install()
    if argv[0] == "-m":
        if len(argv) < 2:
            sys.exit("fullshard.run: -m needs a module name")
        sys.argv = argv[1:]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv
        runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
