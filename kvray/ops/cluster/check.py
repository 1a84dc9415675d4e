"""``kvray cluster check FILE``: check a ``ray up`` cluster config for kvray, offline.

Three layers, each adding to one :class:`ClusterReport` (no problems means the file is fine):

1. **What ``ray up`` itself runs before it talks to a provider** (:mod:`.ray_config`):
   Ray's ``prepare_config`` then ``validate_config``. ``ray up`` then asks the cloud for
   resources it can auto-fill (EC2 instance types); this check does not, so every node type
   must state its ``resources``.
2. **AWS** (:mod:`.aws`): each node type's ``node_config`` as the EC2 ``RunInstances``
   request Ray sends, checked against the EC2 model botocore ships (no network).
3. **kvray** (:mod:`.nodes`, :mod:`.placement`): GPU node types declare their GPUs, the
   ``kvray serve`` in the head commands finds GPUs up when it starts, and the model's
   tensor_parallel_size x pipeline_parallel_size x replicas fits the node types.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from kvray.ops.cluster.aws import check_aws_node_configs
from kvray.ops.cluster.placement import check_kvray
from kvray.ops.cluster.ray_config import ray_prepare_and_validate
from kvray.ops.cluster.report import ClusterReport


def check_cluster_config(path: str | Path, model_config: str | Path | None = None,
                         num_replicas: int | None = None) -> list[str]:
    """Problems of the ``ray up`` cluster config at ``path``; empty when it is fine.

    ``model_config``: a kvray model YAML (default: the ``--config`` of the ``kvray serve``
    command in the head commands). ``num_replicas``: default that command's
    ``--num-replicas``, else 1.
    """
    return check_cluster(path, model_config, num_replicas).problems


def check_cluster(path: str | Path, model_config: str | Path | None = None,
                  num_replicas: int | None = None) -> ClusterReport:
    """:func:`check_cluster_config` with notes (what was checked, what could not be)."""
    report = ClusterReport()
    raw = _load_yaml(path, report)
    if raw is None:
        return report
    config = ray_prepare_and_validate(raw, report)
    if config is None:
        return report
    if config.get("provider", {}).get("type") == "aws":
        check_aws_node_configs(config, report)
    check_kvray(config, model_config, num_replicas, report)
    return report


def _load_yaml(path: str | Path, report: ClusterReport) -> dict | None:
    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as err:
        report.problems.append(f"cannot read {path}: {err.strerror or err}")
        return None
    except yaml.YAMLError as err:
        report.problems.append(f"{path} is not valid YAML: {err}")
        return None
    if not isinstance(data, dict):
        report.problems.append(f"{path} must hold a mapping (a ray up cluster config), "
                               f"got {type(data).__name__}")
        return None
    return data
