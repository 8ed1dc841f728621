"""``python -m fullshard.cli ARGS``: the same as ``fullshard ARGS``."""

from . import entry

if __name__ == "__main__":
    entry()
