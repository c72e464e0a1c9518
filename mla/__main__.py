"""``python -m mla``: the same command line as the ``mla`` console script."""

import sys

from mla.cli import main

sys.exit(main())
