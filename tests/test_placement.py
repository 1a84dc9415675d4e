"""Where a replica's workers go: placement-group bundles, strategies and stage pins from the
config, and the network interface collectives bind to. Pure functions; the same behaviour on
a real three-node cluster is in tests/test_multinode.py."""

from __future__ import annotations

import os

import pytest

from kvray.actors.executor import executor_backend
from kvray.actors.placement import PIN_AMOUNT, node_resource, worker_bundles
from kvray.config import ConfigError, load_config

pytestmark = pytest.mark.unit


def test_bundles_per_rank_without_pins():
    config = load_config(tensor_parallel_size=2, pipeline_parallel_size=2)
    assert worker_bundles(config, use_gpu=False) == [{"CPU": 1}] * 4
    assert worker_bundles(config, use_gpu=True) == [{"CPU": 1, "GPU": 1}] * 4
    assert config.parallel.placement_strategy == "PACK"


def test_stage_pins_put_every_tp_rank_of_a_stage_on_its_node():
    config = load_config(tensor_parallel_size=2, pipeline_parallel_size=3,
                         pipeline_stage_nodes="10.0.0.5, gpu_node_b,fd00::7")
    bundles = worker_bundles(config, use_gpu=False)
    pins = [next(k for k in b if k != "CPU") for b in bundles]
    assert pins == ["node:10.0.0.5"] * 2 + ["gpu_node_b"] * 2 + ["node:fd00::7"] * 2
    assert all(b[p] == PIN_AMOUNT for b, p in zip(bundles, pins, strict=True))
    assert executor_backend(config) == "ray"


def test_a_pinned_single_worker_runs_as_an_actor():
    config = load_config(pipeline_stage_nodes=["10.0.0.9"])
    assert executor_backend(config) == "ray"
    with pytest.raises(ValueError, match="pipeline_stage_nodes pins workers"):
        executor_backend(load_config(pipeline_stage_nodes=["10.0.0.9"],
                                     distributed_executor_backend="uni"))


def test_node_resource_tells_addresses_from_resource_names():
    assert node_resource("192.168.1.20") == "node:192.168.1.20"
    assert node_resource("my_nodes_resource") == "my_nodes_resource"


@pytest.mark.parametrize("kwargs,message", [
    (dict(pipeline_parallel_size=2, pipeline_stage_nodes="10.0.0.1"),
     "needs one node per pipeline stage"),
    (dict(pipeline_parallel_size=2, pipeline_stage_nodes="10.0.0.1,a b"),
     "neither a node IP address nor a resource name"),
    (dict(pipeline_parallel_size=2, pipeline_stage_nodes="10.0.0.1,"),
     "neither a node IP address nor a resource name"),
    (dict(tensor_parallel_size=2, pipeline_stage_nodes="a", placement_strategy="STRICT_SPREAD"),
     "STRICT_SPREAD"),
    (dict(pipeline_parallel_size=2, pipeline_stage_nodes="a,b", placement_strategy="STRICT_PACK"),
     "STRICT_PACK"),
    (dict(placement_strategy="spread"), "placement_strategy"),
])
def test_bad_placement_settings_name_the_field(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        load_config(**kwargs)


def test_collectives_bind_to_the_interface_of_the_node_ip(monkeypatch):
    from kvray.actors.ray_executor import bind_collectives_to

    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        monkeypatch.setenv(var, "")  # recorded, so the teardown restores what was there
        monkeypatch.delenv(var)
    assert bind_collectives_to("127.0.0.1") == "lo"
    assert os.environ["GLOO_SOCKET_IFNAME"] == os.environ["NCCL_SOCKET_IFNAME"] == "lo"
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth7")  # the user's choice wins
    bind_collectives_to("127.0.0.1")
    assert os.environ["GLOO_SOCKET_IFNAME"] == "eth7"
    assert bind_collectives_to("203.0.113.250") is None  # on no interface here
