"""``python -m kvray.testing.netns up | cleanup`` by hand; ``init`` is each node's PID 1."""

from __future__ import annotations

import argparse
import contextlib
import signal
from collections.abc import Sequence

from kvray.testing.netns.cluster import NetnsCluster
from kvray.testing.netns.host import cleanup_stale
from kvray.testing.netns.node_init import node_init


def main(argv: Sequence[str] | None = None) -> None:
    """Parse the command line and run ``init``, ``cleanup`` or ``up``."""
    args = _parser().parse_args(argv)
    if args.cmd == "init":
        node_init(args.hostname, args.root, args.hide, args.ready, args.home, args.keep)
    elif args.cmd == "cleanup":
        for item in cleanup_stale():
            print("removed", item)
    else:
        _up(args.nodes, args.num_cpus, args.ssh)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m kvray.testing.netns")
    sub = parser.add_subparsers(dest="cmd", required=True)
    init = sub.add_parser("init", help=argparse.SUPPRESS)
    for name in ("--hostname", "--root", "--hide", "--ready", "--home"):
        init.add_argument(name, required=True)
    init.add_argument("--keep", action="append", default=[])
    up = sub.add_parser("up", help="start a namespace cluster until Ctrl-C")
    up.add_argument("--nodes", type=int, default=3)
    up.add_argument("--num-cpus", type=int, default=2)
    up.add_argument("--ssh", action="store_true",
                    help="start sshd on every node and no Ray (for `ray up cluster/netns.yaml`)")
    sub.add_parser("cleanup", help="remove what killed runs left behind")
    return parser


def _up(num_nodes: int, num_cpus: int, with_ssh: bool) -> None:
    with NetnsCluster(num_nodes, num_cpus, start_ray=not with_ssh) as cluster:
        if with_ssh:
            print(f"sshd on every node; ssh -i {cluster.enable_ssh()} root@<node ip>")
        print(f"Ray head at {cluster.address}; nodes: "
              + ", ".join(f"{n.hostname}={n.ip} (pid {n.pid})" for n in cluster.nodes)
              + f"; shared dir {cluster.shared}. Run on a node: "
              f"nsenter --target <pid> --net --mount --uts --pid. Ctrl-C stops.",
              flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            signal.pause()


if __name__ == "__main__":
    main()
