"""``python -m kvray.ops.cluster wait-gpus N`` (the cluster configs' head commands)."""

import sys

from kvray.ops.cluster.cli import main

sys.exit(main())
