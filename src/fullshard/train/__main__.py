"""``python -m fullshard.train ARGS``: the same as ``fullshard train ARGS``."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
