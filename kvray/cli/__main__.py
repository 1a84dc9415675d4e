"""``python -m kvray.cli``: the ``kvray`` command."""

import sys

from kvray.cli import main

sys.exit(main())
