"""kvray's own checks of a ``ray up`` config: will ``kvray serve`` find its GPUs and fit?

``kvray serve`` started from the head commands needs GPUs up when it starts (it picks GPU or
CPU workers from the cluster's GPUs at start-up), and ``wait-gpus N`` there must not wait
for more GPUs than start with the cluster. The model's tensor_parallel_size x
pipeline_parallel_size x replicas must fit as ``placement_strategy`` places them: each replica
needs TP x PP ``{CPU: 1, GPU: 1}`` bundles plus ``{CPU: 1}``; under PACK (the default) one TP
group of TP GPUs on one node, PP stages on any nodes; under SPREAD any GPUs; under
STRICT_PACK the whole replica on one node; under STRICT_SPREAD every bundle on a node of its
own. Stages pinned by ``pipeline_stage_nodes`` must name hosts of the cluster (on-prem) with
the GPUs for every replica's stage there.

The kvray model config is ``--model-config FILE``, else the ``--config`` of the
``kvray serve`` command in the head commands (its remote path mapped back through
``file_mounts`` to the local file, relative to the current directory as ``ray up`` resolves
it).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvray.ops.cluster.nodes import Node, cluster_nodes
from kvray.ops.cluster.report import ClusterReport

if TYPE_CHECKING:
    from kvray.config import ParallelConfig


@dataclass
class ServeCommand:
    """The ``kvray serve`` (and any ``wait-gpus`` before it) in the head commands."""

    config_path: str | None = None
    num_replicas: int = 1
    wait_gpus: int | None = None
    command: str = ""
    args: argparse.Namespace | None = None


def check_kvray(config: dict, model_config: str | Path | None,
                num_replicas: int | None, report: ClusterReport) -> None:
    """Report GPU declarations, GPUs at start-up and the model's TP x PP x replicas fit."""
    from kvray.config import FIELD_SECTION, ConfigError, load_config

    nodes = cluster_nodes(config, report)
    serve = _serve_command(config, report)
    if serve is not None:
        _check_gpus_at_start(nodes, serve, report)
    source = _model_config_source(config, model_config, serve, report)
    if source is None:
        return
    path, label = source
    # serve's flags override the model config, whichever config it is.
    overrides: dict[str, Any] = {}
    if serve is not None:
        overrides = {k: getattr(serve.args, k, None) for k in FIELD_SECTION}
    try:
        engine = load_config(path, **overrides)
    except ConfigError as err:
        report.problems.append(f"kvray model config {label}: {err}")
        return
    replicas = num_replicas or (serve.num_replicas if serve else 1)
    if engine.autoscaling.enabled and not num_replicas:  # the most the autoscaler may ask for
        replicas = engine.autoscaling.max_replicas
        label = f"{label}, max_replicas"
    _check_fit(config, nodes, engine.parallel, replicas, label, report)


def _serve_command(config: dict, report: ClusterReport) -> ServeCommand | None:
    """The ``kvray serve`` the head commands start, parsed as kvray's own CLI parses it."""
    keys = ("head_setup_commands", "head_start_ray_commands")
    for command in (str(c) for key in keys for c in config.get(key) or []):
        m = re.search(r"\bkvray\s+serve\b([^'\";&|><\n]*)", command)
        if not m:
            continue
        serve = ServeCommand(command=command)
        if w := re.search(r"kvray(?:\.ops\.|\s+)cluster\s+wait-gpus\s+(\d+)", command):
            serve.wait_gpus = int(w[1])
        from kvray.cli.flags import add_serve_arguments, resolve_num_replicas

        parser = argparse.ArgumentParser(prog="kvray serve")
        add_serve_arguments(parser)
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                args = parser.parse_args(shlex.split(m[1]))
                args.num_replicas = resolve_num_replicas(args)
        except (SystemExit, ValueError) as exc:
            report.problems.append(f"the head command `kvray serve{m[1]}` does not parse as "
                                   f"kvray serve: {err.getvalue().strip() or exc}")
            return None
        serve.config_path, serve.num_replicas, serve.args = args.config, args.num_replicas, args
        return serve
    return None


def _check_gpus_at_start(nodes: list[Node], serve: ServeCommand,
                         report: ClusterReport) -> None:
    if any(n.gpus is None for n in nodes):
        return
    gpu_nodes = [n for n in nodes if n.gpus]
    at_start = sum((n.gpus or 0) * (1 if n.is_head else n.min_workers) for n in nodes)
    if gpu_nodes and at_start == 0:
        names = ", ".join(f"'{n.name}'" for n in gpu_nodes)
        report.problems.append(
            f"the head starts kvray serve, which picks GPU or CPU workers from the GPUs in "
            f"the cluster when it starts, but no GPU starts with the cluster (the head has "
            f"none and min_workers is 0 on {names}): it would run the model on CPU workers; "
            f"set min_workers >= 1 on the GPU node type the model uses")
    if serve.wait_gpus is not None and serve.wait_gpus > at_start:
        report.problems.append(
            f"the head waits for {serve.wait_gpus} GPUs before kvray serve, but only "
            f"{at_start} start with the cluster (head + min_workers): the autoscaler adds "
            f"no node for a wait, so it would wait until its timeout; raise min_workers or "
            f"lower wait-gpus")


def _model_config_source(
        config: dict, model_config: str | Path | None, serve: ServeCommand | None,
        report: ClusterReport) -> tuple[str | Path | None, str | Path] | None:
    """``(file to load, or None for kvray's defaults; its name in messages)``: the
    ``--model-config``, else the served one via file_mounts, else (a serve command without
    ``--config``) kvray's defaults. None when there is none to check (reported)."""
    if model_config is not None:
        return model_config, model_config
    no_config = ("no kvray model config (no `kvray serve --config` in the head commands, no "
                 "--model-config): TP x PP not checked")
    if serve is None:
        report.notes.append(no_config)
        return None
    if serve.config_path is None:
        return None, "kvray serve's defaults and flags"
    local = _local_mount(config, serve.config_path)
    if local is None:
        report.notes.append(f"kvray serve --config {serve.config_path} is not in "
                            f"file_mounts; pass --model-config to check TP x PP")
        report.notes.append(no_config)
        return None
    path = Path(local).expanduser()
    if not path.exists():
        report.problems.append(
            f"file_mounts copies {local} to {serve.config_path} (kvray serve --config) "
            f"but {local} does not exist (relative to the current directory, as ray up "
            f"resolves it: run from the directory the cluster file expects)")
        return None
    return path, path


def _local_mount(config: dict, remote: str) -> str | None:
    """The local source of ``remote`` in ``file_mounts`` (file or folder mounts)."""
    for dest, src in (config.get("file_mounts") or {}).items():
        dest = str(dest).rstrip("/")
        if remote == dest:
            return str(src)
        if remote.startswith(dest + "/"):
            return str(Path(str(src)) / remote[len(dest) + 1:])
    return None


def _check_fit(config: dict, nodes: list[Node], par: ParallelConfig, replicas: int,
               model_config: str | Path, report: ClusterReport) -> None:
    tp, pp, strategy = (par.tensor_parallel_size, par.pipeline_parallel_size,
                        par.placement_strategy)
    what = (f"tensor_parallel_size={tp} x pipeline_parallel_size={pp} x {replicas} "
            f"replica(s) ({model_config})")
    if strategy != "PACK":
        what += f" with placement_strategy={strategy}"
    if any(n.gpus is None for n in nodes):
        report.notes.append(f"{what}: GPUs per host unknown, placement not checked")
        return
    global_max = config.get("max_workers", 0)
    gpu = any(n.gpus for n in nodes)
    if par.pipeline_stage_nodes is not None:
        _check_stage_nodes(config, nodes, par, replicas, what, report)
    elif strategy == "STRICT_PACK":
        _check_one_node_per_replica(nodes, global_max, tp * pp, replicas, gpu, what, report)
        return
    elif strategy == "STRICT_SPREAD":
        _check_node_per_bundle(nodes, global_max, tp * pp, replicas, gpu, what, report)
        return
    if not gpu:
        _check_cpu_fit(nodes, global_max, replicas * (tp * pp + 1), what, report)
    elif strategy == "SPREAD" and par.pipeline_stage_nodes is None:  # TP groups may span nodes
        _check_gpu_fit(nodes, global_max, 1, tp * pp * replicas, what, model_config, report)
    else:
        _check_gpu_fit(nodes, global_max, tp, pp * replicas, what, model_config, report)


def _check_one_node_per_replica(nodes: list[Node], global_max: int, workers: int,
                                replicas: int, gpu: bool, what: str,
                                report: ClusterReport) -> None:
    """STRICT_PACK: a replica's workers and its own bundle all on one node."""

    def fits(n: Node) -> int:  # replicas one node hosts whole
        cpus = n.cpus if n.cpus is not None else 1 << 30
        by_cpu = cpus // (workers + 1)
        return min(by_cpu, (n.gpus or 0) // workers) if gpu else by_cpu

    have = _capacity(nodes, global_max, fits)
    need = f"{workers} GPUs and {workers + 1} CPUs" if gpu else f"{workers + 1} CPUs"
    if have < replicas:
        report.problems.append(f"{what} puts each replica's workers on one node, which "
                               f"needs {need} on one node per replica; the node types host "
                               f"{have} such replica(s)")
    else:
        report.notes.append(f"{what}: fits ({have} replica(s) of {need} on one node)")


def _check_node_per_bundle(nodes: list[Node], global_max: int, workers: int, replicas: int,
                           gpu: bool, what: str, report: ClusterReport) -> None:
    """STRICT_SPREAD: each of a replica's bundles (its workers and its own) on a node of
    its own: workers + 1 distinct nodes, ``workers`` of them with a GPU."""
    worker_nodes = _capacity(nodes, global_max, lambda n: 1 if (n.gpus or not gpu) else 0)
    all_nodes = _capacity(nodes, global_max, lambda n: 1)
    slots = _capacity(nodes, global_max, lambda n: min(
        n.gpus or 0, n.cpus if n.cpus is not None else n.gpus or 0) if gpu else (n.cpus or 1))
    if worker_nodes < workers or all_nodes < workers + 1:
        kind = "GPU nodes" if gpu else "nodes"
        report.problems.append(
            f"{what} needs {workers} {kind} for the workers plus one more node for the "
            f"replica itself, each bundle on a node of its own; the node types give at most "
            f"{worker_nodes} {kind} and {all_nodes} nodes")
    elif slots < workers * replicas:
        report.problems.append(f"{what} needs {workers * replicas} worker slots; the node "
                               f"types give at most {slots}")
    else:
        report.notes.append(f"{what}: fits ({all_nodes} nodes for {workers + 1} bundles "
                            f"per replica)")


def _check_stage_nodes(config: dict, nodes: list[Node], par: ParallelConfig, replicas: int,
                       what: str, report: ClusterReport) -> None:
    """``pipeline_stage_nodes``: on-prem, each pinned IP must be a host of the cluster with
    the GPUs (or CPUs) of every replica's stages there; elsewhere node IPs are known only
    once the nodes run."""
    pins = par.pipeline_stage_nodes or []
    provider = config.get("provider") or {}
    if provider.get("type") != "local" or not all(_is_ip(p) for p in pins):
        report.notes.append(f"{what}: pipeline_stage_nodes {pins} not checked (node IPs and "
                            f"custom resources are known once the nodes run)")
        return
    head, workers = nodes[0], nodes[1]
    hosts = {str(provider.get("head_ip")): head,
             **{str(ip): workers for ip in provider.get("worker_ips") or []}}
    gpu = any(n.gpus for n in nodes)
    for pin in dict.fromkeys(pins):
        node = hosts.get(pin)
        if node is None:
            report.problems.append(
                f"{what}: pipeline_stage_nodes names {pin}, which is not a host of this "
                f"cluster (provider.head_ip, provider.worker_ips: {', '.join(hosts)})")
            continue
        need = pins.count(pin) * par.tensor_parallel_size * replicas
        have = node.gpus if gpu else node.cpus
        if have is not None and have < need:
            unit = "GPUs" if gpu else "CPUs"
            report.problems.append(
                f"{what}: pipeline_stage_nodes puts {pins.count(pin)} stage(s) of "
                f"{par.tensor_parallel_size} workers per replica on {pin} ({need} {unit}); "
                f"it has {have}")


def _is_ip(text: str) -> bool:
    import ipaddress

    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def _check_cpu_fit(nodes: list[Node], global_max: int, need: int, what: str,
                   report: ClusterReport) -> None:
    """CPU workers: {CPU: 1} bundles, PACK, any split over nodes."""
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


def _check_gpu_fit(nodes: list[Node], global_max: int, tp: int, need: int, what: str,
                   model_config: str | Path, report: ClusterReport) -> None:
    """``need`` TP groups (PP stages x replicas), each of ``tp`` GPUs on one node."""
    gpu_nodes = [n for n in nodes if n.gpus]
    biggest = max(gpu_nodes, key=lambda n: n.gpus or 0)
    if (biggest.gpus or 0) < tp:
        report.problems.append(
            f"tensor_parallel_size={tp} needs {tp} GPUs on one node; the largest GPU node "
            f"type '{biggest.name}' has {biggest.gpus} ({model_config})")
        return

    def groups(n: Node) -> int:  # TP groups one node hosts: TP GPUs and TP CPUs each
        return min(n.gpus or 0, n.cpus if n.cpus is not None else n.gpus or 0) // tp

    if not any(groups(n) for n in gpu_nodes):
        report.problems.append(
            f"tensor_parallel_size={tp} needs {tp} GPUs and {tp} CPUs on one node (one "
            f"{{CPU: 1, GPU: 1}} bundle per rank); no GPU node type has both")
        return
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


def _capacity(nodes: list[Node], global_max: int, per_node: Callable[[Node], int]) -> int:
    """Most units (TP groups, CPUs) the head plus at most ``global_max`` workers give."""
    total = sum(per_node(n) for n in nodes if n.is_head)
    left = global_max
    for n in sorted((n for n in nodes if not n.is_head), key=per_node, reverse=True):
        take = min(n.max_workers, left)
        total += take * per_node(n)
        left -= take
    return total
