"""``python -m meshzero``: the ``meshzero`` command."""

import sys

from meshzero.cli import main

if __name__ == "__main__":
    sys.exit(main())
