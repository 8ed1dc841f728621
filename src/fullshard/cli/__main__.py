"""``python -m fullshard.cli ARGS``: the same as ``fullshard ARGS``."""

import sys

from . import main

if __name__ == "__main__":
    sys.exit(main())
