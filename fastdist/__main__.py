"""``python -m fastdist``: the command-line tools (``env``, ``plot``, ``export``); see
:mod:`fastdist.cli`."""

import sys

from fastdist.cli import main

if __name__ == "__main__":
    sys.exit(main())
