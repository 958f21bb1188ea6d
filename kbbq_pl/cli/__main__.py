"""``python -m kbbq_pl.cli``: the ``kbbq-pl`` command."""

import sys

from .commands import main

if __name__ == "__main__":
    sys.exit(main())
