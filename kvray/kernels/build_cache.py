"""One build of the CPU kernels per Ray cluster: a named actor that holds each build's
binary (keyed by the build tag: CPU flags, -march, sources, torch and Python), so that a
node whose own extension cache lacks it takes the binary instead of compiling (~100 s on 2
cores), and hands the build to one node at a time (the others wait for its binary instead
of compiling too). Without Ray, nothing here is used.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)
CACHE_NAME = "kvray-kernel-builds"
CACHE_NAMESPACE = "kvray"
BUILD_LEASE_S = 600.0  # a node that claimed a build and went silent this long loses it
POLL_S = 2.0
CALL_TIMEOUT_S = 30.0  # the cache actor unreachable this long: build (or keep) locally


def cluster_cache() -> Any:
    """The cluster's build cache actor (started if it does not run yet), or None without
    Ray."""
    try:
        import ray
    except ImportError:
        return None
    if not ray.is_initialized():
        return None

    @ray.remote(num_cpus=0)
    class KernelBuilds:
        def __init__(self) -> None:
            self.binaries: dict[str, bytes] = {}
            self.building: dict[str, tuple[str, float]] = {}  # tag -> (node, since)

        def claim(self, tag: str, node: str) -> bytes | bool:
            """The binary if built; True: ``node`` builds it; False: another node does."""
            if tag in self.binaries:
                return self.binaries[tag]
            holder = self.building.get(tag)
            if holder is None or time.monotonic() - holder[1] > BUILD_LEASE_S:
                self.building[tag] = (node, time.monotonic())
                return True
            return holder[0] == node  # the same node: its file lock serialises its builds

        def has(self, tag: str) -> bool:
            return tag in self.binaries

        def publish(self, tag: str, binary: bytes) -> None:
            self.binaries[tag] = binary
            self.building.pop(tag, None)

        def release(self, tag: str, node: str) -> None:
            """``node``'s build failed: another node may try."""
            if self.building.get(tag, ("",))[0] == node:
                del self.building[tag]

    # Outside any placement group: created from a worker inside a replica's group, it would
    # go with that group when the replica dies, and never restart.
    outside = ray.util.scheduling_strategies.PlacementGroupSchedulingStrategy(None)
    return KernelBuilds.options(name=CACHE_NAME, namespace=CACHE_NAMESPACE,
                                get_if_exists=True, lifetime="detached", max_restarts=-1,
                                scheduling_strategy=outside).remote()


def fetch_build(tag: str) -> bytes | None:
    """The cluster's binary for ``tag``: at once if built, after waiting for the node that
    builds it, or None (no Ray, or this node is to build it: then call :func:`publish_build`
    or :func:`release_build`)."""
    cache = cluster_cache()
    if cache is None:
        return None
    import ray

    node = ray.get_runtime_context().get_node_id()
    deadline = time.monotonic() + BUILD_LEASE_S
    try:
        while time.monotonic() < deadline:
            got = ray.get(cache.claim.remote(tag, node), timeout=CALL_TIMEOUT_S)
            if got is True:
                return None
            if got is not False:
                return got
            time.sleep(POLL_S)
    except Exception as err:  # the cache actor is unreachable: build here
        logger.warning("kvray: the cluster's kernel build cache is unreachable (%s)",
                       err.__class__.__name__)
    return None


def publish_build(tag: str, read_binary: Callable[[], bytes]) -> None:
    """Give the cluster this node's binary for ``tag`` unless it has one."""
    cache = cluster_cache()
    if cache is None:
        return
    import ray

    try:
        if not ray.get(cache.has.remote(tag), timeout=CALL_TIMEOUT_S):
            ray.get(cache.publish.remote(tag, read_binary()), timeout=CALL_TIMEOUT_S)
    except Exception as err:  # the cache actor is unreachable: the others build themselves
        logger.warning("kvray: could not share the kernel build (%s)",
                       err.__class__.__name__)


def release_build(tag: str) -> None:
    cache = cluster_cache()
    if cache is not None:
        import ray

        cache.release.remote(tag, ray.get_runtime_context().get_node_id())
