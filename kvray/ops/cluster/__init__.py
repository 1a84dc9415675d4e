"""``kvray cluster``: check a ``ray up`` cluster config for kvray offline, wait on a live one.

Offline (``check``): :mod:`.check` runs Ray's own config checks (:mod:`.ray_config`), the
EC2 request model for AWS (:mod:`.aws`) and kvray's GPU and TP x PP placement
(:mod:`.nodes`, :mod:`.placement`), each adding to one :class:`ClusterReport`. Live
(``wait-gpus``): :mod:`.wait`. The argparse entry points: :mod:`.cli`.
"""

from kvray.ops.cluster.check import check_cluster, check_cluster_config
from kvray.ops.cluster.cli import add_cluster_parser, main
from kvray.ops.cluster.ray_config import VERIFIED_RAY_VERSION
from kvray.ops.cluster.report import ClusterReport
from kvray.ops.cluster.wait import wait_for_gpus

__all__ = ["VERIFIED_RAY_VERSION", "ClusterReport", "add_cluster_parser", "check_cluster",
           "check_cluster_config", "main", "wait_for_gpus"]
