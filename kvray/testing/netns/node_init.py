"""The node's init: PID 1 of a node's PID namespace (``python -m kvray.testing.netns init``).

It runs inside the node's new mount and UTS namespaces: it mounts the node's private
``/tmp``, ``$HOME``, ``/dev/shm`` and ``/etc/hosts``, hides the other nodes' files, sets the
hostname, then only reaps orphans until it is killed (which ends the whole "host").
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path


def node_init(hostname: str, root: str, hide: str, ready: str, home: str,
              keep: Sequence[str]) -> None:
    """Set the node up (``ready`` is written once it is), then reap children forever."""
    _private_mount("/tmp", f"{root}/tmp", keep)
    _private_mount(home, f"{root}/home", keep)
    _mount("-t", "tmpfs", "-o", "size=512m", "tmpfs", "/dev/shm")
    _mount("--bind", f"{root}/hosts", "/etc/hosts")
    Path(ready).write_text("ok")
    _mount("-t", "tmpfs", "-o", "size=1m", "tmpfs", hide)  # the other nodes' files
    socket.sethostname(hostname)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    while True:  # reap orphans (Ray's daemons are reparented here)
        try:
            os.wait()
        except ChildProcessError:
            time.sleep(0.5)


def _mount(*argv: str) -> None:
    subprocess.run(["mount", *argv], check=True)


def _private_mount(mountpoint: str, source: str, keep: Sequence[str]) -> None:
    """Mount ``source`` over ``mountpoint``, with the kept paths under it bound back."""
    for path in keep:
        rel = os.path.relpath(path, mountpoint)
        if rel.startswith(".."):
            continue
        target = os.path.join(source, rel)
        if os.path.isdir(path):
            os.makedirs(target, exist_ok=True)
        else:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            Path(target).touch()
        _mount("--bind", path, target)
    _mount("--rbind", source, mountpoint)
