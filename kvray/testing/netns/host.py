"""The host side of the namespace cluster: what it needs, the names it creates, and how it
finds and removes what a killed run left behind (by name prefix and by an environment mark).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

DEFAULT_SUBNET = "10.213.7"
NS_PREFIX = "kvray-"  # every namespace the harness creates starts with this
LINK_PREFIX = "kv"  # ... and every link: kvb<id> bridge, kvv<id><i> host side of a veth
RUN_ENV = "KVRAY_NETNS_RUN"  # set in every node process: how leftovers are found
BASE_DIR = Path("/var/tmp")  # not /tmp: each node mounts its own over /tmp


def available() -> str | None:
    """None when this machine can host a namespace cluster, else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "unshare", "nsenter", "mount"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed"
    return None


def sh(*argv: str, check: bool = True, timeout: float = 30.0) -> subprocess.CompletedProcess:
    """Run a host command to completion, output captured as text."""
    return subprocess.run(list(argv), check=check, capture_output=True, text=True,
                          timeout=timeout)


def cleanup_stale() -> list[str]:
    """Remove namespaces, links and directories of earlier runs (killed before teardown)."""
    removed = []
    names = sh("ip", "netns", "list", check=False).stdout.split()
    for name in names:
        if name.startswith(NS_PREFIX):
            for pid in sh("ip", "netns", "pids", name, check=False).stdout.split():
                with contextlib.suppress(OSError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
            sh("ip", "netns", "del", name, check=False)
            removed.append(f"netns {name}")
    for line in sh("ip", "-o", "link", "show", check=False).stdout.splitlines():
        name = line.split(":")[1].strip().split("@")[0]
        if name.startswith((f"{LINK_PREFIX}b", f"{LINK_PREFIX}v")) and len(name) >= 9:
            sh("ip", "link", "del", name, check=False)
            removed.append(f"link {name}")
    for path in BASE_DIR.glob("kvray-netns-*"):
        kill_run_processes(path.name.rsplit("-", 1)[1])
        shutil.rmtree(path, ignore_errors=True)
        removed.append(f"directory {path}")
    return removed


def run_processes(run_id: str) -> list[int]:
    """Host PIDs of every process a run started (marked by :data:`RUN_ENV`)."""
    entry = f"{RUN_ENV}={run_id}".encode()
    return [pid for pid in _all_pids() if _has_env(pid, entry)]


def kill_run_processes(run_id: str) -> None:
    """SIGKILL every process of a run, wherever it is (one may escape its PID namespace)."""
    for pid in run_processes(run_id):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def only_child(pid: int, timeout_s: float = 5.0) -> int:
    """The PID of ``pid``'s one child, once it has started."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
            if children:
                return int(children[0])
        time.sleep(0.02)
    raise RuntimeError(f"process {pid} has no child")


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _all_pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _has_env(pid: int, entry: bytes) -> bool:
    try:
        return entry in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False
