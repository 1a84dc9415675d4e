"""``kvray cluster check FILE``: check a ``ray up`` cluster config for kvray, offline.

Three layers, each reported as a list of problems (an empty list means the file is fine):

1. **What ``ray up`` itself runs before it talks to a provider**:
   ``ray.autoscaler._private.util.prepare_config`` (provider defaults, on-prem node type,
   per-type min/max workers) then ``validate_config`` (Ray's JSON schema
   ``ray/autoscaler/ray-schema.json`` plus its own cross-field rules). These are private Ray
   APIs: verified against Ray :data:`VERIFIED_RAY_VERSION`; an import failure says so.
   ``ray up`` then asks the cloud for resources it can auto-fill (EC2 instance types); this
   check does not, so every node type must state its ``resources``.
2. **AWS**: each node type's ``node_config`` as the EC2 ``RunInstances`` request Ray sends
   (``SubnetIds`` resolved to one ``SubnetId``, ``MinCount``/``MaxCount`` and the cluster tag
   added, as Ray's node provider does), checked with botocore's ``ParamValidator`` against
   the EC2 model botocore ships (no network), plus ``InstanceType`` against that model's list.
3. **kvray**: a node type meant for GPU workers (a known GPU instance / machine type, or
   "gpu" in its name) must declare its GPUs; ``kvray serve`` started from the head commands
   needs GPUs up when it starts (it picks GPU or CPU workers from the cluster's GPUs at
   start-up), and ``wait-gpus N`` there must not wait for more GPUs than start with the
   cluster; and the model's tensor_parallel_size x pipeline_parallel_size x replicas must
   fit: each replica needs TP x PP ``{CPU: 1, GPU: 1}`` bundles (PACK) plus ``{CPU: 1}``, one
   TP group of TP GPUs on one node, PP stages on any nodes.

The kvray model config is ``--model-config FILE``, else the ``--config`` of the
``kvray serve`` command in the head commands (its remote path mapped back through
``file_mounts`` to the local file, relative to the current directory as ``ray up`` resolves
it). On-prem (``provider.type: local``) hosts' GPUs are known only when the ``ray start``
commands state ``--num-gpus``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import difflib
import functools
import io
import logging
import re
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

VERIFIED_RAY_VERSION = "2.60.0"
RAY_PRIVATE_API = (
    "ray.autoscaler._private.util.prepare_config",
    "ray.autoscaler._private.util.validate_config",
)

# (vCPUs, GPUs) of EC2 GPU instance types; the rest are not GPU instances as far as this
# check knows (it then trusts the declared resources).
_AWS_GPU_INSTANCES: dict[str, tuple[int, int]] = {}
for _family in ("g5", "g6", "g6e"):
    _AWS_GPU_INSTANCES.update({
        f"{_family}.xlarge": (4, 1), f"{_family}.2xlarge": (8, 1), f"{_family}.4xlarge": (16, 1),
        f"{_family}.8xlarge": (32, 1), f"{_family}.16xlarge": (64, 1),
        f"{_family}.12xlarge": (48, 4), f"{_family}.24xlarge": (96, 4),
        f"{_family}.48xlarge": (192, 8),
    })
_AWS_GPU_INSTANCES.update({
    "g4dn.xlarge": (4, 1), "g4dn.2xlarge": (8, 1), "g4dn.4xlarge": (16, 1),
    "g4dn.8xlarge": (32, 1), "g4dn.16xlarge": (64, 1), "g4dn.12xlarge": (48, 4),
    "g4dn.metal": (96, 8),
    "p3.2xlarge": (8, 1), "p3.8xlarge": (32, 4), "p3.16xlarge": (64, 8),
    "p3dn.24xlarge": (96, 8), "p4d.24xlarge": (96, 8), "p4de.24xlarge": (96, 8),
    "p5.48xlarge": (192, 8), "p5e.48xlarge": (192, 8), "p5en.48xlarge": (192, 8),
})
_GCP_G2_GPUS = {4: 1, 8: 1, 12: 1, 16: 1, 32: 1, 24: 2, 48: 4, 96: 8}


@dataclass
class ClusterReport:
    """What :func:`check_cluster` found: ``problems`` fail the check, ``notes`` inform."""

    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


@dataclass
class _Node:
    """One node type as kvray sees it (on-prem: the head host, or the worker hosts)."""

    name: str
    gpus: int | None
    cpus: int | None
    min_workers: int
    max_workers: int
    is_head: bool


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
    config = _ray_prepare_and_validate(raw, report)
    if config is None:
        return report
    provider = config.get("provider", {}).get("type")
    if provider == "aws":
        _check_aws_node_configs(config, report)
    _check_kvray(config, model_config, num_replicas, report)
    return report


# ---- 0. the file ----------------------------------------------------------------------
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


# ---- 1. what ray up runs ----------------------------------------------------------------
def _ray_private_api():
    """``(prepare_config, validate_config, schema_path)`` from Ray, or raise ImportError
    with a message that names the private API and the verified Ray version."""
    try:
        import ray.autoscaler
        from ray.autoscaler._private.util import prepare_config, validate_config
    except (ImportError, AttributeError) as err:
        version = _ray_version()
        raise ImportError(
            f"kvray cluster check runs Ray's private cluster-launcher API "
            f"({', '.join(RAY_PRIVATE_API)}), verified with ray {VERIFIED_RAY_VERSION}; "
            f"it is not importable from ray {version}: {err}. Install ray[default]=="
            f"{VERIFIED_RAY_VERSION}") from None
    schema = Path(ray.autoscaler.__file__).parent / "ray-schema.json"
    return prepare_config, validate_config, schema


def _ray_version() -> str:
    try:
        from importlib.metadata import version

        return version("ray")
    except Exception:
        return "(not installed)"


def _ray_prepare_and_validate(raw: dict, report: ClusterReport) -> dict | None:
    try:
        prepare_config, validate_config, schema_path = _ray_private_api()
    except ImportError as err:
        report.problems.append(str(err))
        return None
    if _ray_version() != VERIFIED_RAY_VERSION:
        report.notes.append(f"ray {_ray_version()} here; this check was verified with ray "
                            f"{VERIFIED_RAY_VERSION} (it runs Ray's private API)")
    out = io.StringIO()
    try:
        with _captured(out):
            prepared = prepare_config(copy.deepcopy(raw))
    except Exception as err:  # ray up would stop here too, whatever the exception
        report.problems.append(f"ray up's prepare_config rejects it: {_describe(err)}")
        report.problems.extend(_schema_errors(raw, schema_path))
        return None
    _note_ray_output(out.getvalue(), report)
    try:
        with _captured(out):
            validate_config(prepared)
    except (ModuleNotFoundError, ImportError) as err:
        report.problems.append(f"ray up's validate_config needs jsonschema "
                               f"(pip install 'ray[default]'): {err}")
        return None
    except Exception as err:
        errors = _schema_errors(prepared, schema_path)
        report.problems.extend(errors or [f"ray up's validate_config rejects it: "
                                          f"{_describe(err)}"])
        return None
    return prepared


@contextlib.contextmanager
def _captured(out: io.StringIO):
    """Ray's cli_logger output (stdout) and its autoscaler log records of WARNING and up
    into ``out``; its INFO records dropped."""
    handler = logging.StreamHandler(out)
    handler.setLevel(logging.WARNING)
    logger = logging.getLogger("ray.autoscaler")
    saved = logger.handlers[:], logger.propagate
    logger.handlers, logger.propagate = [handler], False
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            yield
    finally:
        logger.handlers, logger.propagate = saved


def _describe(err: BaseException) -> str:
    message = getattr(err, "message", None) or str(err)  # click.ClickException has .message
    if isinstance(err, KeyError):
        message = f"missing key {err}"
    return message.strip() or type(err).__name__


def _note_ray_output(text: str, report: ClusterReport) -> None:
    for line in re.sub(r"\x1b\[[0-9;]*m", "", text).splitlines():
        if line.strip():
            report.notes.append(f"ray: {line.strip()}")


def _schema_errors(config: Any, schema_path: Path) -> list[str]:
    """Every error of ``config`` against Ray's schema, with the path and a did-you-mean."""
    import json

    import jsonschema

    schema = json.loads(schema_path.read_text())
    validator = jsonschema.validators.validator_for(schema)(schema)
    errors = sorted(validator.iter_errors(config), key=lambda e: list(map(str, e.path)))
    return [_format_schema_error(e) for e in errors]


def _format_schema_error(err) -> str:
    where = ".".join(str(p) for p in err.absolute_path) or "top level"
    message = f"ray schema: at {where}: {err.message}"
    if err.validator == "additionalProperties" and isinstance(err.instance, dict):
        known = list(err.schema.get("properties", {}))
        for key in err.instance:
            if key not in known and not err.schema.get("patternProperties"):
                close = difflib.get_close_matches(str(key), known, n=1)
                if close:
                    message += f"; did you mean '{close[0]}' instead of '{key}'?"
    return message


# ---- 2. AWS: node_config as the EC2 RunInstances request -------------------------------------
def _check_aws_node_configs(config: dict, report: ClusterReport) -> None:
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


@functools.lru_cache(maxsize=1)
def _run_instances_shape():
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


# ---- 3. kvray ---------------------------------------------------------------------------------
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


def _flag_int(commands: list, flag: str) -> int | None:
    """The value of ``ray start ... --flag N`` in ``commands``, if stated."""
    for command in commands or []:
        m = re.search(rf"{flag}[= ]+(\d+)", str(command))
        if m and "ray start" in str(command):
            return int(m[1])
    return None


def _nodes(config: dict, report: ClusterReport) -> list[_Node]:
    if config["provider"].get("type") == "local":
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
            _Node(f"head host {config['provider'].get('head_ip')}", head_gpus,
                  _flag_int(config.get("head_start_ray_commands"), "--num-cpus"), 0, 0, True),
            _Node("worker hosts (provider.worker_ips)", worker_gpus,
                  _flag_int(config.get("worker_start_ray_commands"), "--num-cpus"),
                  only.get("min_workers", 0), only.get("max_workers", 0), False),
        ]
    nodes = []
    for name, node_type in config["available_node_types"].items():
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
        nodes.append(_Node(name, gpus or 0, cpus, 1 if head else node_type.get("min_workers", 0),
                           1 if head else node_type.get("max_workers", 0), head))
    return nodes


@dataclass
class _Serve:
    config_path: str | None = None
    num_replicas: int = 1
    wait_gpus: int | None = None
    command: str = ""
    args: argparse.Namespace | None = None


def _serve_command(config: dict, report: ClusterReport) -> _Serve | None:
    """The ``kvray serve`` the head commands start, parsed as kvray's own CLI parses it."""
    keys = ("head_setup_commands", "head_start_ray_commands")
    for command in (str(c) for key in keys for c in config.get(key) or []):
        m = re.search(r"\bkvray\s+serve\b([^'\";&|><\n]*)", command)
        if not m:
            continue
        serve = _Serve(command=command)
        if w := re.search(r"kvray(?:\.ops)?[. ]cluster(?:_check)?\s+wait-gpus\s+(\d+)", command):
            serve.wait_gpus = int(w[1])
        from kvray.cli_flags import add_serve_arguments

        parser = argparse.ArgumentParser(prog="kvray serve")
        add_serve_arguments(parser)
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                args = parser.parse_args(shlex.split(m[1]))
        except (SystemExit, ValueError) as exc:
            report.problems.append(f"the head command `kvray serve{m[1]}` does not parse as "
                                   f"kvray serve: {err.getvalue().strip() or exc}")
            return None
        serve.config_path, serve.num_replicas, serve.args = args.config, args.num_replicas, args
        return serve
    return None


def _local_mount(config: dict, remote: str) -> str | None:
    """The local source of ``remote`` in ``file_mounts`` (file or folder mounts)."""
    for dest, src in (config.get("file_mounts") or {}).items():
        dest = str(dest).rstrip("/")
        if remote == dest:
            return str(src)
        if remote.startswith(dest + "/"):
            return str(Path(str(src)) / remote[len(dest) + 1:])
    return None


def _check_kvray(config: dict, model_config: str | Path | None,
                 num_replicas: int | None, report: ClusterReport) -> None:
    from kvray.config import ConfigError, load_config

    nodes = _nodes(config, report)
    serve = _serve_command(config, report)
    gpu_nodes = [n for n in nodes if n.gpus]
    at_start = sum((n.gpus or 0) * (1 if n.is_head else n.min_workers) for n in nodes)
    unknown_gpus = any(n.gpus is None for n in nodes)

    if serve is not None and gpu_nodes and not unknown_gpus and at_start == 0:
        names = ", ".join(f"'{n.name}'" for n in gpu_nodes)
        report.problems.append(
            f"the head starts kvray serve, which picks GPU or CPU workers from the GPUs in "
            f"the cluster when it starts, but no GPU starts with the cluster (the head has "
            f"none and min_workers is 0 on {names}): it would run the model on CPU workers; "
            f"set min_workers >= 1 on the GPU node type the model uses")
    if serve is not None and serve.wait_gpus is not None and not unknown_gpus \
            and serve.wait_gpus > at_start:
        report.problems.append(
            f"the head waits for {serve.wait_gpus} GPUs before kvray serve, but only "
            f"{at_start} start with the cluster (head + min_workers): the autoscaler adds "
            f"no node for a wait, so it would wait until its timeout; raise min_workers or "
            f"lower wait-gpus")

    # The model config: --model-config, else the served one via file_mounts, else (a serve
    # command without --config) kvray's defaults; serve's flags override it either way.
    label: str | Path | None = model_config
    if model_config is None and serve is not None:
        if serve.config_path is None:
            label = "kvray serve's defaults and flags"
        elif (local := _local_mount(config, serve.config_path)) is None:
            report.notes.append(f"kvray serve --config {serve.config_path} is not in "
                                f"file_mounts; pass --model-config to check TP x PP")
        elif not Path(local).expanduser().exists():
            report.problems.append(
                f"file_mounts copies {local} to {serve.config_path} (kvray serve --config) "
                f"but {local} does not exist (relative to the current directory, as ray up "
                f"resolves it: run from the directory the cluster file expects)")
            return
        else:
            model_config = label = Path(local).expanduser()
    if label is None:
        report.notes.append("no kvray model config (no `kvray serve --config` in the head "
                            "commands, no --model-config): TP x PP not checked")
        return
    overrides: dict[str, Any] = {}
    if serve is not None:
        from kvray.config import FIELD_SECTION

        overrides = {k: getattr(serve.args, k, None) for k in FIELD_SECTION}
    try:
        engine = load_config(model_config, **overrides)
    except ConfigError as err:
        report.problems.append(f"kvray model config {label}: {err}")
        return
    replicas = num_replicas or (serve.num_replicas if serve else 1)
    _check_fit(config, nodes, engine.parallel.tensor_parallel_size,
               engine.parallel.pipeline_parallel_size, replicas, label, report)


def _check_fit(config: dict, nodes: list[_Node], tp: int, pp: int, replicas: int,
               model_config, report: ClusterReport) -> None:
    what = (f"tensor_parallel_size={tp} x pipeline_parallel_size={pp} x {replicas} "
            f"replica(s) ({model_config})")
    if any(n.gpus is None for n in nodes):
        report.notes.append(f"{what}: GPUs per host unknown, placement not checked")
        return
    gpu_nodes = [n for n in nodes if n.gpus]
    global_max = config.get("max_workers", 0)
    if not gpu_nodes:  # CPU workers: {CPU: 1} bundles, PACK, any split over nodes
        need = replicas * (tp * pp + 1)
        if any(n.cpus is None for n in nodes):
            report.notes.append(f"{what}: a CPU-only cluster whose CPU counts are not all "
                                f"stated: placement not checked")
            return
        have = _capacity(nodes, global_max, lambda n: n.cpus or 0)
        if have < need:
            report.problems.append(f"{what} needs {need} CPUs (one per worker and engine) on "
                                   f"a CPU-only cluster; the node types give at most {have}")
        else:
            report.notes.append(f"{what}: fits on CPUs ({have} available, {need} needed)")
        return
    biggest = max(gpu_nodes, key=lambda n: n.gpus or 0)
    if (biggest.gpus or 0) < tp:
        report.problems.append(
            f"tensor_parallel_size={tp} needs {tp} GPUs on one node; the largest GPU node "
            f"type '{biggest.name}' has {biggest.gpus} ({model_config})")
        return

    def groups(n: _Node) -> int:  # TP groups one node hosts: TP GPUs and TP CPUs each
        return min(n.gpus or 0, n.cpus if n.cpus is not None else n.gpus or 0) // tp

    if not any(groups(n) for n in gpu_nodes):
        report.problems.append(
            f"tensor_parallel_size={tp} needs {tp} GPUs and {tp} CPUs on one node (one "
            f"{{CPU: 1, GPU: 1}} bundle per rank); no GPU node type has both")
        return
    need = pp * replicas
    have = _capacity(nodes, global_max, groups)
    if have < need:
        detail = ", ".join(f"'{n.name}': {groups(n)} per node x "
                           f"{'1 (head)' if n.is_head else f'max_workers {n.max_workers}'}"
                           for n in nodes if groups(n))
        report.problems.append(
            f"{what} needs {need} groups of {tp} GPUs, each on one node (PP stages may span "
            f"nodes); the node types host at most {have} ({detail}; global max_workers "
            f"{global_max})")
        return
    report.notes.append(f"{what}: fits ({have} TP group(s) of {tp} GPUs available, "
                        f"{need} needed)")


def _capacity(nodes: list[_Node], global_max: int, per_node) -> int:
    """Most units (TP groups, CPUs) the head plus at most ``global_max`` workers give."""
    total = sum(per_node(n) for n in nodes if n.is_head)
    left = global_max
    for n in sorted((n for n in nodes if not n.is_head), key=per_node, reverse=True):
        take = min(n.max_workers, left)
        total += take * per_node(n)
        left -= take
    return total


# ---- CLI ------------------------------------------------------------------------------------
def _cmd_check(args: argparse.Namespace) -> int:
    report = check_cluster(args.file, args.model_config, args.num_replicas)
    for note in report.notes:
        print(f"  note: {note}", file=sys.stderr if report.problems else sys.stdout)
    if report.problems:
        print(f"kvray cluster check: {args.file}: {len(report.problems)} problem(s):",
              file=sys.stderr)
        for problem in report.problems:
            print(f"  - {problem}", file=sys.stderr)
        return 2
    print(f"kvray cluster check: {args.file}: ok")
    return 0


def wait_for_gpus(count: int, timeout_s: float, address: str = "auto",
                  poll_s: float = 5.0) -> bool:
    """Wait until the Ray cluster at ``address`` has ``count`` GPUs; False on timeout."""
    import ray

    ray.init(address=address, logging_level="WARNING", log_to_driver=False)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            have = ray.cluster_resources().get("GPU", 0)
            if have >= count:
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(poll_s)
    finally:
        ray.shutdown()


def _cmd_wait_gpus(args: argparse.Namespace) -> int:
    if wait_for_gpus(args.gpus, args.timeout, args.address):
        return 0
    print(f"kvray cluster wait-gpus: the cluster has fewer than {args.gpus} GPUs after "
          f"{args.timeout:g} s", file=sys.stderr)
    return 2


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _add_actions(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="cluster_action", metavar="ACTION", required=True)
    check = actions.add_parser(
        "check", help="check a `ray up` cluster config for kvray, offline",
        description="Run what `ray up` runs before it contacts a provider (Ray's "
        "prepare_config + validate_config), EC2 RunInstances parameter checks for AWS, and "
        "kvray's GPU / tensor x pipeline parallel placement checks. Exit 0: ok; 2: problems "
        "(listed on stderr).")
    check.add_argument("file", metavar="FILE", help="cluster YAML (as for `ray up FILE`)")
    check.add_argument("--model-config", metavar="FILE", default=None,
                       help="kvray model YAML to place (default: the --config of the "
                            "`kvray serve` in the head commands, through file_mounts)")
    check.add_argument("--num-replicas", type=_positive_int, default=None, metavar="N",
                       help="model replicas (default: that command's --num-replicas, else 1)")
    check.set_defaults(func=_cmd_check)
    wait = actions.add_parser(
        "wait-gpus", help="wait until the running Ray cluster has N GPUs (head commands)")
    wait.add_argument("gpus", type=_positive_int, metavar="N")
    wait.add_argument("--timeout", type=float, default=1800.0, metavar="S",
                      help="give up after S seconds, exit 2 (default 1800)")
    wait.add_argument("--address", default="auto", help="Ray address (default auto)")
    wait.set_defaults(func=_cmd_wait_gpus)


def add_cluster_parser(subparsers) -> None:
    """Add ``cluster`` (``check FILE``, ``wait-gpus N``) to kvray's subcommands."""
    cluster = subparsers.add_parser(
        "cluster", help="`ray up` cluster configs: check one offline, wait for GPUs")
    _add_actions(cluster)


def main(argv: list[str] | None = None) -> int:
    """``python -m kvray.ops.cluster_check check FILE`` / ``wait-gpus N``."""
    parser = argparse.ArgumentParser(prog="python -m kvray.ops.cluster_check",
                                     description="`ray up` cluster configs for kvray.")
    _add_actions(parser)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
