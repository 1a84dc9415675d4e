"""`ray up` end to end with the `local` provider over ssh, on a three-node namespace
cluster (kvray.testing.netns): cluster/netns.yaml brings Ray up on every host and starts
`kvray serve` on the head, the `openai` client on the host gets a completion, `ray exec`
works, and `ray down` leaves no Ray or kvray process on any host. Needs root, sshd and
rsync (Debian: openssh-server rsync; .ci/run installs them)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from kvray.ops.cluster import check_cluster
from kvray.testing import netns
from tests.helpers.server import wait_for_health
from tests.helpers.skips import skip_or_fail_in_ci
from tests.helpers.tiny_models import make_tiny_model

pytestmark = pytest.mark.multinode

CONFIG = Path(__file__).resolve().parents[1] / "cluster" / "netns.yaml"
RAY = str(Path(sys.executable).with_name("ray"))


@pytest.fixture(scope="module")
def cluster():
    why = netns.available() or next(
        (f"`{tool}` is not installed" for tool in ("sshd", "rsync", "ssh")
         if shutil.which(tool) is None and not Path(f"/usr/sbin/{tool}").exists()), None)
    if why:
        skip_or_fail_in_ci(f"no ssh namespace cluster here: {why}",
                           ".ci/run installs openssh-server and rsync and runs as root")
    from torch.utils.cpp_extension import get_default_build_root

    from kvray.kernels import cpu_ops

    cpu_ops.load_ops()  # every host reads these builds (an NFS home would share them)
    netns.cleanup_stale()
    _forget_local_cluster_state()
    with netns.NetnsCluster(num_nodes=3, start_ray=False,
                            keep=[get_default_build_root()]) as c:
        yield c
    _forget_local_cluster_state()
    assert c.leftovers() == []


def _forget_local_cluster_state() -> None:
    """`ray up` with the local provider keeps the hosts' state under /tmp/ray on this
    machine; a stale one (an interrupted run) would make the next `ray up` skip hosts."""
    for path in Path("/tmp/ray").glob("cluster-kvray-netns.*"):
        path.unlink(missing_ok=True)


def _config_for(cluster, key: Path, path: Path) -> Path:
    """cluster/netns.yaml with this run's key (and addresses, if the subnet differs)."""
    text = CONFIG.read_text().replace(netns.DEFAULT_SUBNET + ".", cluster.subnet + ".")
    config = yaml.safe_load(text)
    config["auth"]["ssh_private_key"] = str(key)
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def _ray_cli(*args: str, timeout: float) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    return subprocess.run([RAY, *args], capture_output=True, text=True, timeout=timeout,
                          env=env)


def _leftover_processes(cluster) -> dict[int, list[str]]:
    """Per node, every process but its init and sshd."""
    found = {}
    for node in cluster.nodes:
        out = cluster.run(node, ["ps", "-e", "-o", "pid=,args="]).stdout
        procs = [line.strip() for line in out.splitlines()
                 if line.strip() and not line.strip().startswith("1 ")
                 and "sshd" not in line and "ps -e -o" not in line]
        if procs:
            found[node.index] = procs
    return found


def test_ray_up_serves_a_completion_and_ray_down_leaves_nothing(cluster, tmp_path):
    import openai
    from torch.utils.cpp_extension import get_default_build_root

    make_tiny_model("llama_gqa", cluster.shared / "model")
    key = cluster.enable_ssh({"TORCH_EXTENSIONS_DIR": get_default_build_root()})
    config = _config_for(cluster, key, tmp_path / "cluster.yaml")
    assert check_cluster(config).problems == []
    head = cluster.head
    try:
        up = _ray_cli("up", "-y", "--no-config-cache", str(config), timeout=600)
        assert up.returncode == 0, up.stdout[-4000:] + up.stderr[-4000:]

        # The workers join through the autoscaler on the head, after `ray up` returns.
        code = ("import ray, time\nray.init(address='auto', log_to_driver=False)\n"
                "deadline = time.monotonic() + 240\n"
                "while sum(n['Alive'] for n in ray.nodes()) < 3 and time.monotonic() < deadline:"
                "\n    time.sleep(1)\nprint('NODES', sum(n['Alive'] for n in ray.nodes()))")
        joined = cluster.python(head, code, timeout=300)
        assert "NODES 3" in joined.stdout, joined.stderr[-3000:]

        exec_key = _ray_cli("exec", str(config), "cat ~/kvray-api-key", timeout=120)
        assert exec_key.returncode == 0, exec_key.stderr[-3000:]
        api_key = exec_key.stdout.strip().splitlines()[-1]
        base = f"http://{head.ip}:8000"
        try:
            wait_for_health(base, 300)
        except pytest.fail.Exception:
            log = _ray_cli("exec", str(config), "tail -50 ~/kvray-serve.log", timeout=60)
            pytest.fail(f"kvray serve did not come up: {log.stdout[-4000:]}")
        client = openai.OpenAI(base_url=f"{base}/v1", api_key=api_key, max_retries=0)
        done = client.completions.create(model="model", prompt="Hello", max_tokens=8,
                                         extra_body={"ignore_eos": True})
        assert done.usage.completion_tokens == 8
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{base}/v1", api_key="wrong", max_retries=0).models.list()
    finally:
        down = _ray_cli("down", "-y", str(config), timeout=300)
    assert down.returncode == 0, down.stdout[-3000:] + down.stderr[-3000:]
    deadline = time.monotonic() + 90  # workers stop Ray ~15-20 s after the head's GCS
    while (left := _leftover_processes(cluster)) and time.monotonic() < deadline:
        time.sleep(2)
    assert left == {}, left
