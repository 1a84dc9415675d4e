"""The nodes a ``ray up`` config can bring up, as kvray's placement check sees them.

A node type meant for GPU workers (a known GPU instance / machine type, or "gpu" in its name)
must declare its GPUs. On-prem (``provider.type: local``) hosts' GPUs are known only when the
``ray start`` commands state ``--num-gpus``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from types import MappingProxyType

from kvray.ops.cluster.report import ClusterReport

# (vCPUs, GPUs) of EC2 GPU instance types; the rest are not GPU instances as far as this
# check knows (it then trusts the declared resources).
_AWS_GPU_INSTANCES = MappingProxyType({
    **{f"{family}.{size}": shape for family in ("g5", "g6", "g6e") for size, shape in {
        "xlarge": (4, 1), "2xlarge": (8, 1), "4xlarge": (16, 1), "8xlarge": (32, 1),
        "16xlarge": (64, 1), "12xlarge": (48, 4), "24xlarge": (96, 4), "48xlarge": (192, 8),
    }.items()},
    "g4dn.xlarge": (4, 1), "g4dn.2xlarge": (8, 1), "g4dn.4xlarge": (16, 1),
    "g4dn.8xlarge": (32, 1), "g4dn.16xlarge": (64, 1), "g4dn.12xlarge": (48, 4),
    "g4dn.metal": (96, 8),
    "p3.2xlarge": (8, 1), "p3.8xlarge": (32, 4), "p3.16xlarge": (64, 8),
    "p3dn.24xlarge": (96, 8), "p4d.24xlarge": (96, 8), "p4de.24xlarge": (96, 8),
    "p5.48xlarge": (192, 8), "p5e.48xlarge": (192, 8), "p5en.48xlarge": (192, 8),
})
# GPUs of GCP g2-standard-<vCPUs> machine types.
_GCP_G2_GPUS = MappingProxyType({4: 1, 8: 1, 12: 1, 16: 1, 32: 1, 24: 2, 48: 4, 96: 8})


@dataclass
class Node:
    """One node type as kvray sees it (on-prem: the head host, or the worker hosts)."""

    name: str
    gpus: int | None
    cpus: int | None
    min_workers: int
    max_workers: int
    is_head: bool


def cluster_nodes(config: dict, report: ClusterReport) -> list[Node]:
    """The node types of a prepared ``ray up`` config; GPU declarations checked."""
    if config["provider"].get("type") == "local":
        return _on_prem_nodes(config, report)
    return [_node_type(name, node_type, config, report)
            for name, node_type in config["available_node_types"].items()]


def _on_prem_nodes(config: dict, report: ClusterReport) -> list[Node]:
    # prepare_config made one node type for all hosts; ray start detects their GPUs.
    only = next(iter(config["available_node_types"].values()))
    head_gpus = _flag_int(config.get("head_start_ray_commands"), "--num-gpus")
    worker_gpus = _flag_int(config.get("worker_start_ray_commands"), "--num-gpus")
    if head_gpus is None or worker_gpus is None:
        report.notes.append(
            "on-prem hosts' GPUs are detected by `ray start` on each host: state "
            "--num-gpus in head_start_ray_commands and worker_start_ray_commands to let "
            "this check verify GPU placement")
    return [
        Node(f"head host {config['provider'].get('head_ip')}", head_gpus,
             _flag_int(config.get("head_start_ray_commands"), "--num-cpus"), 0, 0, True),
        Node("worker hosts (provider.worker_ips)", worker_gpus,
             _flag_int(config.get("worker_start_ray_commands"), "--num-cpus"),
             only.get("min_workers", 0), only.get("max_workers", 0), False),
    ]


def _node_type(name: str, node_type: dict, config: dict, report: ClusterReport) -> Node:
    resources = node_type.get("resources") or {}
    hint, known_cpus, known_gpus = _gpu_hint(name, node_type.get("node_config") or {})
    gpus, cpus = resources.get("GPU"), resources.get("CPU")
    if hint and not gpus:
        need = f'"GPU": {known_gpus}' if known_gpus else '"GPU": <count>'
        report.problems.append(
            f"node type '{name}' is meant for GPU workers ({hint}) but its resources "
            f"declare no GPU: Ray would place none of kvray's {{CPU: 1, GPU: 1}} worker "
            f"bundles there (this offline check asks no cloud API, so state them): add "
            f"{need} to its resources")
    elif known_gpus is not None and gpus and gpus > known_gpus:
        report.problems.append(
            f"node type '{name}' declares GPU: {gpus} but {hint}: Ray would schedule "
            f"workers onto GPUs that do not exist")
    if known_cpus is not None and cpus and cpus > known_cpus:
        report.problems.append(
            f"node type '{name}' declares CPU: {cpus} but it has {known_cpus} vCPUs")
    if cpus is None:
        report.notes.append(f"node type '{name}' states no CPU count: ray up asks the "
                            f"cloud for it; CPU fit is not checked there")
    head = name == config.get("head_node_type")
    return Node(name, gpus or 0, cpus, 1 if head else node_type.get("min_workers", 0),
                1 if head else node_type.get("max_workers", 0), head)


def _gpu_hint(name: str, node_config: dict) -> tuple[str | None, int | None, int | None]:
    """Why a node type looks meant for GPUs, and its known (vCPUs, GPUs) if any."""
    itype = node_config.get("InstanceType")
    if isinstance(itype, str) and itype in _AWS_GPU_INSTANCES:
        cpus, gpus = _AWS_GPU_INSTANCES[itype]
        return f"InstanceType {itype} has {gpus} GPU(s)", cpus, gpus
    machine = node_config.get("machineType")
    if isinstance(machine, str):
        if m := re.fullmatch(r"a2-(?:high|ultra)gpu-(\d+)g", machine):
            return f"machineType {machine} has {m[1]} GPU(s)", 12 * int(m[1]), int(m[1])
        if machine == "a2-megagpu-16g":
            return f"machineType {machine} has 16 GPUs", 96, 16
        if re.fullmatch(r"a3-(?:high|mega|ultra|edge)gpu-8g", machine):
            return f"machineType {machine} has 8 GPUs", None, 8
        if (m := re.fullmatch(r"g2-standard-(\d+)", machine)) and int(m[1]) in _GCP_G2_GPUS:
            gpus = _GCP_G2_GPUS[int(m[1])]
            return f"machineType {machine} has {gpus} GPU(s)", int(m[1]), gpus
    accelerators = node_config.get("guestAccelerators")
    if isinstance(accelerators, list) and accelerators:
        count = sum(int(a.get("acceleratorCount", 0)) for a in accelerators
                    if isinstance(a, dict) and str(a.get("acceleratorCount", "0")).isdigit())
        return f"guestAccelerators attach {count} GPU(s)", None, count or None
    if "gpu" in name.lower():
        return "its name says GPU", None, None
    return None, None, None


def _flag_int(commands: list | None, flag: str) -> int | None:
    """The value of ``ray start ... --flag N`` in ``commands``, if stated."""
    for command in commands or []:
        m = re.search(rf"{flag}[= ]+(\d+)", str(command))
        if m and "ray start" in str(command):
            return int(m[1])
    return None
