"""AWS: each node type's ``node_config`` checked as the EC2 ``RunInstances`` request Ray sends.

The request is built as Ray's node provider builds it (``SubnetIds`` resolved to one
``SubnetId``, ``MinCount``/``MaxCount`` and the cluster tag added), then checked with
botocore's ``ParamValidator`` against the EC2 model botocore ships (no network), plus
``InstanceType`` against that model's list.
"""

from __future__ import annotations

import copy
import difflib
import functools
from typing import Any

from kvray.ops.cluster.report import ClusterReport


def check_aws_node_configs(config: dict, report: ClusterReport) -> None:
    """Report every node type whose ``node_config`` EC2 RunInstances would reject."""
    try:
        import botocore
        from botocore.validate import ParamValidator
    except ImportError:
        report.problems.append(
            "checking AWS node_config needs botocore (ray up on AWS needs boto3 anyway): "
            "pip install boto3")
        return
    shape = _run_instances_shape()
    instance_types = set(shape.members["InstanceType"].enum or ())
    cluster_tag = {"Key": "ray-cluster-name", "Value": str(config.get("cluster_name"))}
    for name, node_type in config["available_node_types"].items():
        request = _run_instances_request(name, node_type, cluster_tag, report)
        result = ParamValidator().validate(request, shape)
        for error in getattr(result, "_errors", None) or []:
            report.problems.append(f"node type '{name}': {_format_boto_error(error)}")
        if result.has_errors() and not getattr(result, "_errors", None):
            report.problems.append(f"node type '{name}': EC2 RunInstances rejects its "
                                   f"node_config: {result.generate_report()}")
        itype = request.get("InstanceType")
        if isinstance(itype, str) and instance_types and itype not in instance_types:
            close = difflib.get_close_matches(itype, instance_types, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            report.problems.append(
                f"node type '{name}': InstanceType '{itype}' is not an EC2 instance type "
                f"(botocore {botocore.__version__}'s EC2 model){hint}")


def _run_instances_request(name: str, node_type: dict, cluster_tag: dict,
                           report: ClusterReport) -> dict:
    """The RunInstances parameters Ray sends for one node of ``node_type``."""
    request = copy.deepcopy(node_type.get("node_config") or {})
    for key in ("MinCount", "MaxCount"):
        if key in request:
            report.notes.append(
                f"node type '{name}': node_config.{key} is ignored: Ray sets MinCount 1 "
                f"and MaxCount = the nodes it launches")
    # As ray's AWSNodeProvider._create_node: SubnetIds is Ray's own key, resolved to one
    # SubnetId (filled by bootstrap when absent), and it sets MinCount, MaxCount, tags.
    subnet_ids = request.pop("SubnetIds", None)
    if "NetworkInterfaces" in request:
        request.pop("SecurityGroupIds", None)
    elif isinstance(subnet_ids, list) and subnet_ids:
        request["SubnetId"] = subnet_ids[0]
    user_tags = request.get("TagSpecifications")
    tags = [{"ResourceType": "instance", "Tags": [cluster_tag]}]
    request["TagSpecifications"] = tags + (user_tags if isinstance(user_tags, list)
                                           else [] if user_tags is None else [user_tags])
    request.update({"MinCount": 1, "MaxCount": max(1, node_type.get("max_workers", 1))})
    return request


@functools.lru_cache(maxsize=1)
def _run_instances_shape() -> Any:
    """The EC2 RunInstances input shape from the service model botocore ships (offline)."""
    import botocore.session

    return (botocore.session.get_session().get_service_model("ec2")
            .operation_model("RunInstances").input_shape)


def _format_boto_error(error: tuple) -> str:
    kind, name, extra = error
    where = "node_config" + (name if name.startswith((".", "[")) else f".{name}" if name
                             else "")
    if kind == "unknown field":
        param, valid = extra["unknown_param"], extra["valid_names"]
        close = difflib.get_close_matches(param, valid, n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        return f"{where}.{param} is not an EC2 RunInstances parameter{hint}"
    if kind == "invalid type":
        wants = ", ".join(t.replace("<class '", "").replace("'>", "")
                          for t in extra["valid_types"])
        return (f"{where} = {extra['param']!r} ({type(extra['param']).__name__}): "
                f"EC2 RunInstances wants {wants}")
    if kind == "missing required field":
        return f"{where} lacks the required EC2 RunInstances parameter {extra['required_name']}"
    if kind in ("invalid range", "invalid length"):
        return f"{where} = {extra['param']!r}: below EC2's minimum {extra['min_allowed']}"
    return f"{where}: EC2 RunInstances: {kind} {extra}"
