"""The ``kvray cluster`` subcommands (``check FILE``, ``wait-gpus N``), also run as
``python -m kvray.ops.cluster`` where the ``kvray`` script is not on the PATH."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from kvray.ops.cluster.check import check_cluster
from kvray.ops.cluster.wait import wait_for_gpus


def add_cluster_parser(subparsers: Any) -> None:
    """Add ``cluster`` (``check FILE``, ``wait-gpus N``) to kvray's subcommands."""
    cluster = subparsers.add_parser(
        "cluster", help="`ray up` cluster configs: check one offline, wait for GPUs")
    _add_actions(cluster)


def main(argv: list[str] | None = None) -> int:
    """``python -m kvray.ops.cluster check FILE`` / ``wait-gpus N``."""
    parser = argparse.ArgumentParser(prog="python -m kvray.ops.cluster",
                                     description="`ray up` cluster configs for kvray.")
    _add_actions(parser)
    args = parser.parse_args(argv)
    return args.func(args)


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
