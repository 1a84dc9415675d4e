"""A Ray cluster of several "hosts" on one machine, each in its own network namespace.

Each node is a network namespace (own IP on a private test subnet, joined by veth pairs to
a bridge the harness creates), its own PID namespace (so ``ray stop`` or a crash there
touches only that node's processes, and killing the namespace's init kills the whole
"host"), its own UTS namespace (own hostname, which — as on Debian — resolves to
``127.0.1.1`` through the node's private ``/etc/hosts``) and its own mount namespace with a
private ``/tmp``, ``/dev/shm`` and ``$HOME``. Ray, gloo and the object store therefore talk
over a network between processes that cannot see each other's files. One directory,
:attr:`NetnsCluster.shared`, is visible to every node (as an NFS mount would be): put the
model there.

The subnet is ``10.213.7.0/24`` unless ``KVRAY_NETNS_SUBNET`` names another ``/24`` prefix
(``10.213.7``): the bridge is ``.1`` (the host's address on it), node ``i`` is ``.(10+i)``.
The namespaces get no default route, so nothing but these addresses and loopback can be
reached from a node; :meth:`NetnsCluster.routes` lets a test check it.

Needs root, ``ip`` (iproute2), ``unshare`` and ``nsenter`` (util-linux). Used by the tests
(``tests/test_multinode.py``) and by hand::

    sudo python -m kvray.testing.netns up --nodes 3     # prints the head address; Ctrl-C ends it
    sudo python -m kvray.testing.netns cleanup          # removes what a killed run left behind

Teardown kills every node, deletes the namespaces, links and bridge and the directories,
even when a test fails; :meth:`NetnsCluster.leftovers` lists anything that survived.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_SUBNET = "10.213.7"
NS_PREFIX = "kvray-"  # every namespace the harness creates starts with this
LINK_PREFIX = "kv"  # ... and every link: kvb<id> bridge, kvv<id><i> host side of a veth
RUN_ENV = "KVRAY_NETNS_RUN"  # set in every node process: how leftovers are found
BASE_DIR = Path("/var/tmp")  # not /tmp: each node mounts its own over /tmp
RAY_PORT = 6379

# Ray notices a dead node after period x threshold; its default (~30 s) is tuned for clouds.
FAST_HEALTH_CHECKS = {
    "RAY_health_check_initial_delay_ms": "1000",
    "RAY_health_check_period_ms": "1000",
    "RAY_health_check_timeout_ms": "1000",
    "RAY_health_check_failure_threshold": "3",
}


def available() -> str | None:
    """None when this machine can host a namespace cluster, else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "unshare", "nsenter", "mount"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed"
    return None


def _sh(*argv: str, check: bool = True, timeout: float = 30.0) -> subprocess.CompletedProcess:
    return subprocess.run(list(argv), check=check, capture_output=True, text=True,
                          timeout=timeout)


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
        taken = _sh("ip", "-4", "-o", "addr", "show").stdout
        if f" {self.bridge_ip}/" in taken:
            raise RuntimeError(
                f"{self.bridge_ip} is already assigned on this host (a leftover run? "
                "`python -m kvray.testing.netns cleanup`; or set KVRAY_NETNS_SUBNET)")
        self.shared.mkdir(parents=True)
        _sh("ip", "link", "add", self.bridge, "type", "bridge")
        _sh("ip", "addr", "add", f"{self.bridge_ip}/24", "dev", self.bridge)
        _sh("ip", "link", "set", self.bridge, "up")
        for node in self.nodes:
            host_end, node_end = self._veth(node)
            _sh("ip", "netns", "add", node.netns)
            _sh("ip", "link", "add", host_end, "type", "veth", "peer", "name", node_end)
            _sh("ip", "link", "set", node_end, "netns", node.netns)
            _sh("ip", "link", "set", host_end, "master", self.bridge)
            _sh("ip", "link", "set", host_end, "up")
            ns = ("ip", "-n", node.netns)
            _sh(*ns, "link", "set", node_end, "name", "eth0")
            _sh(*ns, "addr", "add", f"{node.ip}/24", "dev", "eth0")
            _sh(*ns, "link", "set", "eth0", "up")
            _sh(*ns, "link", "set", "lo", "up")

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
        node.pid = _only_child(node.init.pid)

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
        return bool(node.pid) and _pid_alive(node.pid)

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
            _sh("ip", "netns", "del", node.netns, check=False)
            _sh("ip", "link", "del", self._veth(node)[0], check=False)
        _sh("ip", "link", "del", self.bridge, check=False)
        for pid in self._processes():  # anything that escaped its PID namespace
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
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
        while node.pid and _pid_alive(node.pid) and time.monotonic() < deadline:
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
        keys.mkdir(mode=0o700, exist_ok=True)
        for name in ("host_ed25519", "id_ed25519"):
            if not (keys / name).exists():
                _sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"kvray-{name}",
                    "-f", str(keys / name))
        (keys / "authorized_keys").write_text((keys / "id_ed25519.pub").read_text())
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege separation
        env = {"PATH": f"{Path(sys.executable).parent}:/usr/local/sbin:/usr/local/bin:"
                       "/usr/sbin:/usr/bin:/sbin:/bin",
               "RAY_USAGE_STATS_ENABLED": "0", RUN_ENV: self.run_id,
               "KVRAY_NETNS_SHARED": str(self.shared), **(session_env or {})}
        for node in self.nodes:
            # A login shell resets PATH (/etc/profile); `ray up` sources ~/.bashrc first.
            (node.root / "home" / ".bashrc").write_text(f'export PATH="{env["PATH"]}"\n')
            conf = keys / f"sshd_{node.index}.conf"
            conf.write_text("\n".join([
                f"ListenAddress {node.ip}:22", f"HostKey {keys / 'host_ed25519'}",
                f"AuthorizedKeysFile {keys / 'authorized_keys'}",
                "PermitRootLogin prohibit-password", "PasswordAuthentication no",
                "KbdInteractiveAuthentication no", "UsePAM no", "StrictModes no",
                "PidFile /tmp/sshd.pid", "MaxStartups 100", "MaxSessions 100",
                "SetEnv " + " ".join(f"{k}={v}" for k, v in env.items()), ""]))
            with open(keys / f"sshd_{node.index}.log", "wb") as log:
                self.sshd.append(self.popen(node, [sshd, "-D", "-e", "-f", str(conf)],
                                            stdout=subprocess.DEVNULL, stderr=log))
        deadline = time.monotonic() + timeout_s
        for node in self.nodes:
            while True:
                with contextlib.suppress(OSError), socket.create_connection((node.ip, 22), 1):
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"sshd on node {node.index} did not start: "
                                       f"{(keys / f'sshd_{node.index}.log').read_text()}")
                time.sleep(0.1)
        return keys / "id_ed25519"

    # ---- checks ---------------------------------------------------------------------------
    def routes(self, node: Node) -> list[str]:
        """The node's IPv4 routes: only its own subnet (no default route)."""
        out = _sh("ip", "-n", node.netns, "-4", "route", "show").stdout
        return [line.strip() for line in out.splitlines() if line.strip()]

    def _processes(self) -> list[int]:
        return [pid for pid in _all_pids() if _has_env(pid, f"{RUN_ENV}={self.run_id}")]

    def leftovers(self) -> list[str]:
        """Whatever of this run is still on the host (empty after :meth:`stop`)."""
        found = []
        names = _sh("ip", "netns", "list", check=False).stdout
        found += [f"netns {n.netns}" for n in self.nodes if n.netns in names]
        links = _sh("ip", "-o", "link", "show", check=False).stdout
        found += [f"link {name}" for name in
                  [self.bridge, *(self._veth(n)[0] for n in self.nodes)]
                  if f" {name}:" in links or f" {name}@" in links]
        found += [f"process {pid}" for pid in self._processes()]
        if self.base.exists():
            found.append(f"directory {self.base}")
        return found


def _repo_root() -> str:
    """The directory holding the ``kvray`` package (a checkout, or site-packages)."""
    return str(Path(__file__).resolve().parents[2])


def _only_child(pid: int, timeout_s: float = 5.0) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
            if children:
                return int(children[0])
        time.sleep(0.02)
    raise RuntimeError(f"process {pid} has no child")


def _all_pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _has_env(pid: int, entry: str) -> bool:
    try:
        return entry.encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False


def _pid_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def cleanup_stale() -> list[str]:
    """Remove namespaces, links and directories of earlier runs (killed before teardown)."""
    removed = []
    names = _sh("ip", "netns", "list", check=False).stdout.split()
    for name in names:
        if name.startswith(NS_PREFIX):
            for pid in _sh("ip", "netns", "pids", name, check=False).stdout.split():
                with contextlib.suppress(OSError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
            _sh("ip", "netns", "del", name, check=False)
            removed.append(f"netns {name}")
    for line in _sh("ip", "-o", "link", "show", check=False).stdout.splitlines():
        name = line.split(":")[1].strip().split("@")[0]
        if name.startswith((f"{LINK_PREFIX}b", f"{LINK_PREFIX}v")) and len(name) >= 9:
            _sh("ip", "link", "del", name, check=False)
            removed.append(f"link {name}")
    for path in BASE_DIR.glob("kvray-netns-*"):
        for pid in _all_pids():
            if _has_env(pid, f"{RUN_ENV}={path.name.rsplit('-', 1)[1]}"):
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
        shutil.rmtree(path, ignore_errors=True)
        removed.append(f"directory {path}")
    return removed


# ---- the node's init (runs as PID 1 of the node's PID namespace) ----------------------------
def _node_init(hostname: str, root: str, hide: str, ready: str, home: str,
               keep: Sequence[str]) -> None:
    def mount(*argv: str) -> None:
        subprocess.run(["mount", *argv], check=True)

    def private(mountpoint: str, source: str) -> None:
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
            mount("--bind", path, target)
        mount("--rbind", source, mountpoint)

    private("/tmp", f"{root}/tmp")
    private(home, f"{root}/home")
    mount("-t", "tmpfs", "-o", "size=512m", "tmpfs", "/dev/shm")
    mount("--bind", f"{root}/hosts", "/etc/hosts")
    Path(ready).write_text("ok")
    mount("-t", "tmpfs", "-o", "size=1m", "tmpfs", hide)  # the other nodes' files
    socket.sethostname(hostname)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    while True:  # reap orphans (Ray's daemons are reparented here)
        try:
            os.wait()
        except ChildProcessError:
            time.sleep(0.5)


def main(argv: Sequence[str] | None = None) -> None:
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
    args = parser.parse_args(argv)
    if args.cmd == "init":
        _node_init(args.hostname, args.root, args.hide, args.ready, args.home, args.keep)
    elif args.cmd == "cleanup":
        for item in cleanup_stale():
            print("removed", item)
    else:
        with NetnsCluster(args.nodes, args.num_cpus, start_ray=not args.ssh) as cluster:
            if args.ssh:
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
