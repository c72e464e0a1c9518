"""``python -m mla.check``: run the GPU check command."""

import sys

from mla.check.runner import main

sys.exit(main())
