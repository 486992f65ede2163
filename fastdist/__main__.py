"""``python -m fastdist``: the command-line tools (``env``, ``plot``); see :mod:`fastdist.cli`."""

import sys

from fastdist.cli import main

if __name__ == "__main__":
    sys.exit(main())
