"""The namespace cluster itself: its nodes, their life cycle, and running things on them.

Node ``i`` is network namespace ``kvray-<run>-<i>`` at ``<subnet>.(10+i)``, joined by a veth
pair to the bridge ``kvb<run>`` at ``<subnet>.1``; its init (:mod:`.node_init`) holds its PID,
UTS and mount namespaces, and everything run on the node enters them with ``nsenter``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

from kvray.testing.netns.host import (
    BASE_DIR,
    DEFAULT_SUBNET,
    LINK_PREFIX,
    NS_PREFIX,
    RUN_ENV,
    available,
    kill_run_processes,
    only_child,
    pid_alive,
    run_processes,
    sh,
)
from kvray.testing.netns.ssh import make_keys, sshd_config, wait_for_sshd

RAY_PORT = 6379

# Ray notices a dead node after period x threshold; its default (~30 s) is tuned for clouds.
FAST_HEALTH_CHECKS = MappingProxyType({
    "RAY_health_check_initial_delay_ms": "1000",
    "RAY_health_check_period_ms": "1000",
    "RAY_health_check_timeout_ms": "1000",
    "RAY_health_check_failure_threshold": "3",
})


@dataclass
class Node:
    """One fake host."""

    index: int
    netns: str  # network namespace name
    ip: str
    hostname: str
    root: Path  # its private files on the host (hidden from the other nodes)
    resource: str  # a custom Ray resource only this node has (1 unit)
    init: subprocess.Popen | None = field(default=None, repr=False)  # `unshare --fork`
    pid: int = 0  # host PID of the namespace's PID 1: killing it ends every process there


class NetnsCluster:
    """``num_nodes`` Ray nodes, node 0 the head; a context manager (start / teardown)."""

    def __init__(self, num_nodes: int = 3, num_cpus: int = 2, object_store_mb: int = 120,
                 subnet: str | None = None, fast_health_checks: bool = True,
                 ray_env: dict[str, str] | None = None, start_ray: bool = True,
                 keep: Sequence[str] = ()) -> None:
        if not 1 <= num_nodes <= 200:
            raise ValueError(f"num_nodes must be in [1, 200], got {num_nodes}")
        self.run_id = uuid.uuid4().hex[:6]
        self.subnet = subnet or os.environ.get("KVRAY_NETNS_SUBNET", DEFAULT_SUBNET)
        parts = self.subnet.split(".")
        if len(parts) != 3 or not all(p.isdigit() and int(p) < 256 for p in parts):
            raise ValueError(f"subnet must be a /24 prefix like {DEFAULT_SUBNET!r}, "
                             f"got {self.subnet!r}")
        self.num_cpus, self.object_store_mb = num_cpus, object_store_mb
        self.ray_env = dict(FAST_HEALTH_CHECKS if fast_health_checks else {})
        self.ray_env.update(ray_env or {})
        self.base = BASE_DIR / f"kvray-netns-{self.run_id}"
        self.shared = self.base / "shared"
        self.bridge = f"{LINK_PREFIX}b{self.run_id}"
        self.bridge_ip = f"{self.subnet}.1"
        self.nodes = [
            Node(i, f"{NS_PREFIX}{self.run_id}-{i}", f"{self.subnet}.{10 + i}",
                 f"kvnode{i}", self.base / "nodes" / f"n{i}", f"kvray_node_{i}")
            for i in range(num_nodes)
        ]
        self.start_ray = start_ray
        # Host paths every node still sees under its private /tmp and $HOME: the Python
        # and packages it runs (a venv or checkout may live in either), plus ``keep``.
        self.keep = sorted({str(Path(p).resolve()) for p in (
            sys.prefix, sys.base_prefix, _repo_root(), *keep)})
        self.home = str(Path.home())
        self.sshd: list[subprocess.Popen] = []
        self._started = False

    # ---- life cycle ---------------------------------------------------------------------
    def __enter__(self) -> NetnsCluster:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def head(self) -> Node:
        return self.nodes[0]

    @property
    def address(self) -> str:
        """The Ray address other nodes and drivers join."""
        return f"{self.head.ip}:{RAY_PORT}"

    def start(self, timeout_s: float = 120.0) -> None:
        """Network, node namespaces, then Ray on every node; waits until all nodes joined."""
        why = available()
        if why:
            raise RuntimeError(f"cannot build a namespace cluster: {why}")
        self._started = True
        try:
            self._make_network()
            for node in self.nodes:
                self._start_init(node)
            if self.start_ray:
                self._start_ray(timeout_s)
        except BaseException:
            self.stop()
            raise

    def _make_network(self) -> None:
        taken = sh("ip", "-4", "-o", "addr", "show").stdout
        if f" {self.bridge_ip}/" in taken:
            raise RuntimeError(
                f"{self.bridge_ip} is already assigned on this host (a leftover run? "
                "`python -m kvray.testing.netns cleanup`; or set KVRAY_NETNS_SUBNET)")
        self.shared.mkdir(parents=True)
        sh("ip", "link", "add", self.bridge, "type", "bridge")
        sh("ip", "addr", "add", f"{self.bridge_ip}/24", "dev", self.bridge)
        sh("ip", "link", "set", self.bridge, "up")
        for node in self.nodes:
            host_end, node_end = self._veth(node)
            sh("ip", "netns", "add", node.netns)
            sh("ip", "link", "add", host_end, "type", "veth", "peer", "name", node_end)
            sh("ip", "link", "set", node_end, "netns", node.netns)
            sh("ip", "link", "set", host_end, "master", self.bridge)
            sh("ip", "link", "set", host_end, "up")
            ns = ("ip", "-n", node.netns)
            sh(*ns, "link", "set", node_end, "name", "eth0")
            sh(*ns, "addr", "add", f"{node.ip}/24", "dev", "eth0")
            sh(*ns, "link", "set", "eth0", "up")
            sh(*ns, "link", "set", "lo", "up")

    def _veth(self, node: Node) -> tuple[str, str]:
        suffix = f"{self.run_id}{node.index}"
        return f"{LINK_PREFIX}v{suffix}", f"{LINK_PREFIX}p{suffix}"

    def _start_init(self, node: Node) -> None:
        """The node's init: new PID, UTS and mount namespaces inside its network namespace;
        it mounts the private directories, sets the hostname, then only reaps children."""
        for sub in ("tmp", "home"):
            (node.root / sub).mkdir(parents=True, exist_ok=True)
        (node.root / "hosts").write_text(
            f"127.0.0.1\tlocalhost\n127.0.1.1\t{node.hostname}\n"
            "::1\tlocalhost ip6-localhost ip6-loopback\n")
        ready = node.root / "ready"
        argv = ["ip", "netns", "exec", node.netns,
                "unshare", "--pid", "--fork", "--mount-proc", "--uts", "--mount",
                "--propagation", "private", "--",
                sys.executable, "-m", "kvray.testing.netns", "init",
                "--hostname", node.hostname, "--root", str(node.root),
                "--hide", str(self.base / "nodes"), "--ready", str(ready),
                "--home", self.home, *(f"--keep={k}" for k in self.keep)]
        log = open(node.root / "init.log", "wb")  # noqa: SIM115 (kept open by the child)
        node.init = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                     env=self._clean_env(), start_new_session=True)
        log.close()
        deadline = time.monotonic() + 30
        while not ready.exists():
            if node.init.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"node {node.index} did not start: "
                                   f"{(node.root / 'init.log').read_text()[-2000:]}")
            time.sleep(0.05)
        # `unshare --fork` is the namespace's parent; PID 1 inside it is its only child.
        node.pid = only_child(node.init.pid)

    def _start_ray(self, timeout_s: float) -> None:
        for node in self.nodes:
            self._ray_start(node, timeout_s)
        self.wait_for_nodes(len(self.nodes), timeout_s)

    def _ray_start(self, node: Node, timeout_s: float) -> None:
        argv = [str(Path(sys.executable).with_name("ray")), "start",
                "--node-ip-address", node.ip, f"--num-cpus={self.num_cpus}",
                f"--resources={json.dumps({node.resource: 1})}",
                f"--object-store-memory={self.object_store_mb << 20}",
                "--disable-usage-stats"]
        if node is self.head:
            argv += ["--head", f"--port={RAY_PORT}", "--include-dashboard=false"]
        else:
            argv += [f"--address={self.address}"]
        proc = self.run(node, argv, timeout=timeout_s, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"`ray start` failed on node {node.index}:\n"
                               f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")

    def is_alive(self, index: int) -> bool:
        """Whether node ``index``'s init (and so the node) still runs."""
        node = self.nodes[index]
        return bool(node.pid) and pid_alive(node.pid)

    def restart_node(self, index: int, timeout_s: float = 120.0) -> None:
        """Boot a killed worker node again (fresh /tmp and /dev/shm) and rejoin Ray."""
        node = self.nodes[index]
        if node is self.head:
            raise ValueError("the head cannot be restarted: the cluster is gone with it")
        self._kill_init(node)
        shutil.rmtree(node.root, ignore_errors=True)
        self._start_init(node)
        self._ray_start(node, timeout_s)
        self.wait_for_nodes(len(self.nodes), timeout_s)

    def wait_for_nodes(self, count: int, timeout_s: float = 60.0) -> None:
        """Until exactly ``count`` nodes are alive in Ray's view (asked on the head)."""
        code = (
            "import ray, sys, time\n"
            "ray.init(log_to_driver=False)\n"
            f"deadline = time.monotonic() + {timeout_s}\n"
            "while True:\n"
            "    alive = sum(n['Alive'] for n in ray.nodes())\n"
            f"    if alive == {count}: break\n"
            "    if time.monotonic() > deadline: sys.exit(f'{alive} nodes alive')\n"
            "    time.sleep(0.5)\n")
        proc = self.run(self.head, [sys.executable, "-c", code], timeout=timeout_s + 30,
                        check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"waiting for {count} Ray nodes: {proc.stderr[-3000:]}")

    def stop(self) -> None:
        """Kill every node, delete namespaces, links, bridge and directories (idempotent)."""
        if not self._started:
            return
        for node in self.nodes:
            self._kill_init(node)
        for node in self.nodes:
            sh("ip", "netns", "del", node.netns, check=False)
            sh("ip", "link", "del", self._veth(node)[0], check=False)
        sh("ip", "link", "del", self.bridge, check=False)
        kill_run_processes(self.run_id)  # anything that escaped its PID namespace
        shutil.rmtree(self.base, ignore_errors=True)
        self._started = False

    def _kill_init(self, node: Node) -> None:
        if node.init is None:
            return
        with contextlib.suppress(OSError):
            os.kill(node.pid or node.init.pid, signal.SIGKILL)
        with contextlib.suppress(OSError):
            os.kill(node.init.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            node.init.wait(timeout=10)

    def kill_node(self, index: int) -> None:
        """The host dies: every process of node ``index`` (raylet, workers) is killed at
        once; its network stays, so peers see their connections reset."""
        node = self.nodes[index]
        self._kill_init(node)
        deadline = time.monotonic() + 10
        while node.pid and pid_alive(node.pid) and time.monotonic() < deadline:
            time.sleep(0.05)

    # ---- running things on a node ------------------------------------------------------
    def env(self, node: Node, extra: dict[str, str] | None = None) -> dict[str, str]:
        """The environment of a process on ``node``: private HOME, Ray pointed at the head."""
        env = self._clean_env()
        env.update(self.ray_env)
        env.update({"HOME": self.home, "TMPDIR": "/tmp", "RAY_ADDRESS": self.address,
                    RUN_ENV: self.run_id})
        env.update(extra or {})
        return env

    def _clean_env(self) -> dict[str, str]:
        """The host's environment without Ray's or kvray's settings (tests set some)."""
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("RAY_", "KVRAY_")) and k not in ("TMPDIR", "HOME")}
        # Ray binds 127.0.0.1 when this is 0 (the tests' single-node setting): not here.
        env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "1"
        env["RAY_AUTH_MODE"] = "disabled"
        env["RAY_USAGE_STATS_ENABLED"] = "0"
        env[RUN_ENV] = self.run_id
        return env

    def _nsenter(self, node: Node, argv: Sequence[str]) -> list[str]:
        if node.init is None or node.init.poll() is not None:
            raise RuntimeError(f"node {node.index} is not running")
        return ["nsenter", f"--target={node.pid}", "--net", "--mount", "--uts",
                "--pid", "--wd=/", "--", *argv]

    def run(self, node: Node, argv: Sequence[str], timeout: float = 120.0,
            check: bool = True, env: dict[str, str] | None = None,
            input: str | None = None) -> subprocess.CompletedProcess:
        """Run ``argv`` on ``node`` to completion; output captured as text."""
        proc = subprocess.run(self._nsenter(node, argv), capture_output=True, text=True,
                              timeout=timeout, env=self.env(node, env), input=input)
        if check and proc.returncode != 0:
            raise subprocess.CalledProcessError(proc.returncode, argv, proc.stdout,
                                                proc.stderr)
        return proc

    def popen(self, node: Node, argv: Sequence[str], env: dict[str, str] | None = None,
              **kwargs) -> subprocess.Popen:
        """Start ``argv`` on ``node`` in the background (it dies with the node)."""
        return subprocess.Popen(self._nsenter(node, argv), env=self.env(node, env),
                                start_new_session=True, **kwargs)

    def python(self, node: Node, code: str, timeout: float = 300.0,
               env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        """Run a Python program on ``node`` (the same interpreter and packages)."""
        return self.run(node, [sys.executable, "-c", code], timeout=timeout, check=False,
                        env=env)

    # ---- ssh (for `ray up` with the local provider) ----------------------------------------
    def enable_ssh(self, session_env: dict[str, str] | None = None,
                   timeout_s: float = 30.0) -> Path:
        """Start sshd on every node (port 22 of its IP; Debian's openssh-server) with a
        throwaway host key and client key made for this run; root may log in with the key
        only. ``session_env`` (plus PATH with this Python's bin directory first) is set in
        every ssh session. Returns the private key's path."""
        sshd = shutil.which("sshd") or "/usr/sbin/sshd"
        if not Path(sshd).exists():
            raise RuntimeError("sshd is not installed (Debian: apt-get install "
                               "openssh-server rsync)")
        keys = self.shared / "ssh"
        make_keys(keys)
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege separation
        env = {"PATH": f"{Path(sys.executable).parent}:/usr/local/sbin:/usr/local/bin:"
                       "/usr/sbin:/usr/bin:/sbin:/bin",
               "RAY_USAGE_STATS_ENABLED": "0", RUN_ENV: self.run_id,
               "KVRAY_NETNS_SHARED": str(self.shared), **(session_env or {})}
        for node in self.nodes:
            # A login shell resets PATH (/etc/profile); `ray up` sources ~/.bashrc first.
            (node.root / "home" / ".bashrc").write_text(f'export PATH="{env["PATH"]}"\n')
            conf = keys / f"sshd_{node.index}.conf"
            conf.write_text(sshd_config(node.ip, keys, env))
            with open(keys / f"sshd_{node.index}.log", "wb") as log:
                self.sshd.append(self.popen(node, [sshd, "-D", "-e", "-f", str(conf)],
                                            stdout=subprocess.DEVNULL, stderr=log))
        deadline = time.monotonic() + timeout_s
        for node in self.nodes:
            wait_for_sshd(node.ip, deadline, keys / f"sshd_{node.index}.log",
                              f"node {node.index}")
        return keys / "id_ed25519"

    # ---- checks ---------------------------------------------------------------------------
    def routes(self, node: Node) -> list[str]:
        """The node's IPv4 routes: only its own subnet (no default route)."""
        out = sh("ip", "-n", node.netns, "-4", "route", "show").stdout
        return [line.strip() for line in out.splitlines() if line.strip()]

    def leftovers(self) -> list[str]:
        """Whatever of this run is still on the host (empty after :meth:`stop`)."""
        found = []
        names = sh("ip", "netns", "list", check=False).stdout
        found += [f"netns {n.netns}" for n in self.nodes if n.netns in names]
        links = sh("ip", "-o", "link", "show", check=False).stdout
        found += [f"link {name}" for name in
                  [self.bridge, *(self._veth(n)[0] for n in self.nodes)]
                  if f" {name}:" in links or f" {name}@" in links]
        found += [f"process {pid}" for pid in run_processes(self.run_id)]
        if self.base.exists():
            found.append(f"directory {self.base}")
        return found


def _repo_root() -> str:
    """The directory holding the ``kvray`` package (a checkout, or site-packages)."""
    return str(Path(__file__).resolve().parents[3])
