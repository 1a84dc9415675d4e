"""RayExecutor: one model replica as TP x PP ``Worker`` actors in a placement group.

Each step's SchedulerOutput is put into the object store once and the same reference is
handed to every worker; only the last stage's TP rank 0 returns tokens. If a worker dies,
the step fails with :class:`WorkerDiedError` at once (never a hang), the surviving actors and
the placement group are torn down, and the engine may build a new executor.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from kvray.actors.placement import worker_bundles
from kvray.actors.worker import Worker, free_port
from kvray.config import EngineConfig
from kvray.models.loader import check_parallel_layout
from kvray.scheduler.output import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)

PLACEMENT_TIMEOUT_S = 30.0
STARTUP_TIMEOUT_S = 600.0  # actor start and model load (at least worker_timeout_s)


class WorkerDiedError(RuntimeError):
    """A worker actor of the replica died; in-flight requests cannot finish."""


class PlacementError(RuntimeError):
    """The Ray cluster cannot host the replica's workers; the message names what is missing."""


def ensure_ray(address: str | None = None, num_cpus: int | None = None,
               log_to_driver: bool = False) -> bool:
    """Join the cluster at ``address`` or ``RAY_ADDRESS`` (``"auto"`` = the one started on this
    machine with ``ray start``), else start a private one bound to 127.0.0.1 with enough
    logical CPUs for the workers. Never probes for a cluster unasked: a stale address file
    makes that probe hang for minutes. True when this call started a new local cluster
    (its caller then stops it with :func:`stop_ray`)."""
    address = address or os.environ.get("RAY_ADDRESS")
    if not address:
        # Read by Ray at import: with it (and the node address) every listener stays on
        # 127.0.0.1. Not when joining a cluster: the driver must find its node by its IP.
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray

    if ray.is_initialized():
        return False
    if address:
        ray.init(address=address, log_to_driver=log_to_driver)
        return False
    ray.init(address="local", num_cpus=num_cpus, _node_ip_address="127.0.0.1",
             include_dashboard=False, log_to_driver=log_to_driver)
    return True


def stop_ray() -> None:
    """Stop the local cluster :func:`ensure_ray` started, leaving no Ray process behind.

    ``ray.shutdown`` stops the head's processes, but the raylet's children (dashboard and
    runtime-env agents, workers) can outlive it by a minute when their last report to the
    GCS blocks; their pids are taken first and whatever is left is killed."""
    import signal

    import psutil
    import ray

    pids: set[int] = set()
    node = getattr(ray._private.worker, "_global_node", None)
    for infos in (getattr(node, "all_processes", None) or {}).values():
        for info in infos:
            with contextlib.suppress(psutil.Error):
                proc = psutil.Process(info.process.pid)
                pids.add(proc.pid)
                pids.update(c.pid for c in proc.children(recursive=True))
    import threading

    stopper = threading.Thread(target=ray.shutdown, name="kvray-ray-shutdown", daemon=True)
    stopper.start()
    stopper.join(15.0)  # a cluster whose raylet is gone can block it: bounded
    deadline = time.monotonic() + 2.0
    while pids and time.monotonic() < deadline:
        pids = {p for p in pids if _alive(p)}
        time.sleep(0.1)
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


class _RankedWorker:
    """The actor body: builds a Worker once the rendezvous address is known."""

    def __init__(self, config: EngineConfig, model_path: str, rank: int) -> None:
        self.config, self.model_path, self.rank = config, model_path, rank
        self.worker: Worker | None = None

    def node_address(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    def pick_rendezvous(self, same_node: bool) -> str:
        """A file store when every rank is on this node (no listening socket at all);
        otherwise a TCP store on a port the OS picks here."""
        if same_node:
            self.rendezvous_file = os.path.join(
                tempfile.gettempdir(), f"kvray-rendezvous-{uuid.uuid4().hex}")
            return f"file://{self.rendezvous_file}"
        host = self.node_address()
        return f"tcp://{host}:{free_port(host)}"

    def cleanup(self) -> None:
        path = getattr(self, "rendezvous_file", None)
        if path and os.path.exists(path):
            os.remove(path)

    def init_worker(self, init_method: str | None) -> None:
        bind_collectives_to(self.node_address())
        self.worker = Worker(self.config, self.model_path, self.rank, init_method)

    def run_method(self, method: str, *args: Any) -> Any:
        """Call the Worker's ``method`` (what :meth:`RayExecutor.collective_rpc` sends)."""
        return getattr(self.worker, method)(*args)

    def execute_model(self, out: SchedulerOutput, prev: ModelRunnerOutput | None = None
                      ) -> ModelRunnerOutput | None:
        return self.worker.execute_model(out, prev)  # the hot path keeps a typed method


def merge_offloaded(per_rank: list[dict[int, list]]) -> dict[int, list]:
    """Blocks copied out by every worker (rank order): key -> [(handle, nbytes)] per rank;
    a block some worker could not store is left out (its other shards are useless)."""
    merged: dict[int, list] = {}
    for key in per_rank[0]:
        if all(key in shard for shard in per_rank):
            merged[key] = [part for shard in per_rank for part in shard[key]]
    return merged


class RayExecutor:
    """The :class:`~kvray.actors.executor.Executor` over TP x PP Ray worker actors."""

    def __init__(self, config: EngineConfig, model_path: str) -> None:
        par = config.parallel
        self.timeout_s = par.worker_timeout_s
        self.startup_timeout_s = max(STARTUP_TIMEOUT_S, self.timeout_s)
        self.tp, self.pp = par.tensor_parallel_size, par.pipeline_parallel_size
        if Path(model_path).exists():  # (share_weights: maybe only on another node)
            check_parallel_layout(model_path, self.tp, self.pp, par.enable_expert_parallel)
        ensure_ray(num_cpus=max(self.tp * self.pp + 2, 4))
        bundles = worker_bundles(config, _cluster_has_gpus())
        first_bundle = self._reserve_placement(bundles, par.placement_strategy)
        self.workers = self._spawn_workers(config, model_path, bundles, first_bundle)
        try:
            self._init_workers()
        except BaseException:
            self.shutdown()
            raise
        self.output_rank = (self.pp - 1) * self.tp  # last stage, TP rank 0
        self.broadcast_s = 0.0  # time spent putting SchedulerOutputs in the object store
        self._last_step: list | None = None  # the latest step's calls, one per worker

    def _reserve_placement(self, bundles: list[dict], strategy: str) -> int:
        """Set ``self.pg`` to the placement group the workers go in; returns the index of
        the first worker's bundle."""
        import ray
        from ray.util.placement_group import placement_group

        # Inside a Serve replica whose deployment reserved bundles for the workers (see
        # kvray.serve.app), use those: Serve then accounts for the workers' resources.
        current = ray.util.get_current_placement_group()
        if current is not None and len(current.bundle_specs) >= self.tp * self.pp + 1:
            self.pg, self._owns_pg = current, False
            return 1
        self.pg = placement_group(bundles, strategy=strategy)
        self._owns_pg = True
        self._wait_for_placement(bundles, strategy)
        return 0

    def _spawn_workers(self, config: EngineConfig, model_path: str, bundles: list[dict],
                       first_bundle: int) -> list:
        """One actor per rank, each in its bundle (nothing loaded yet)."""
        import ray

        actor_cls = ray.remote(_RankedWorker)
        strategy = ray.util.scheduling_strategies.PlacementGroupSchedulingStrategy
        return [
            actor_cls.options(
                num_cpus=bundles[rank]["CPU"], num_gpus=bundles[rank].get("GPU", 0),
                scheduling_strategy=strategy(placement_group=self.pg,
                                             placement_group_bundle_index=first_bundle + rank),
            ).remote(config, model_path, rank)
            for rank in range(self.tp * self.pp)
        ]

    def _init_workers(self) -> None:
        """Find each rank's node, agree on a rendezvous, build every Worker (joining the
        process group and loading its shard), and read the model's facts."""
        nodes = self._get([w.node_address.remote() for w in self.workers],
                          self.startup_timeout_s)
        self.worker_nodes = nodes  # node IP of each rank
        logger.info("kvray workers (rank: node): %s",
                    ", ".join(f"{r}: {ip}" for r, ip in enumerate(nodes)))
        init_method = self._get(
            [self.workers[0].pick_rendezvous.remote(len(set(nodes)) == 1)])[0]
        if len(self.workers) == 1:
            init_method = "single"  # no process group, but size threads as an actor
        self._get([w.init_worker.remote(init_method) for w in self.workers],
                  self.startup_timeout_s)
        self.spec, self.max_model_len = self._get(
            [self.workers[-self.tp].run_method.remote("model_info")])[0]

    def _wait_for_placement(self, bundles: list[dict], strategy: str) -> None:
        import ray

        ready, _ = ray.wait([self.pg.ready()], timeout=PLACEMENT_TIMEOUT_S)
        if ready:
            return
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(self.pg)
        need: dict[str, float] = {}
        for bundle in bundles:
            for key, value in bundle.items():
                need[key] = need.get(key, 0) + value
        alive = [n for n in ray.nodes() if n.get("Alive")]
        raise PlacementError(
            f"the Ray cluster cannot place {len(bundles)} workers (tensor_parallel_size="
            f"{self.tp} x pipeline_parallel_size={self.pp}, placement_strategy={strategy}) "
            f"within {PLACEMENT_TIMEOUT_S:.0f} s: one bundle per worker {bundles} (in all "
            f"{need}); the cluster's {len(alive)} live nodes have "
            f"{_available_by_node(alive)} available; add nodes or resources, or lower the "
            "parallel sizes")

    # ---- calls -------------------------------------------------------------------------
    def _get(self, refs: list, timeout_s: float | None = None) -> list:
        """ray.get that fails as soon as any actor dies, instead of waiting on peers that are
        blocked in a collective with it, and treats a worker that does not answer within
        ``worker_timeout_s`` (frozen, hung in a collective) as dead."""
        import ray
        from ray.exceptions import RayActorError

        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        pending, done = list(refs), {}
        deadline = time.monotonic() + timeout_s
        while pending:
            ready, pending = ray.wait(pending, num_returns=1,
                                      timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                self.shutdown()
                raise WorkerDiedError(f"a kvray worker actor did not answer within "
                                      f"{timeout_s:g} s (worker_timeout_s); the workers "
                                      "were stopped")
            try:
                done[ready[0]] = ray.get(ready[0])
            except RayActorError as err:
                self.shutdown()
                raise WorkerDiedError(
                    f"a kvray worker actor died ({err.__class__.__name__}): {err}") from err
        return [done[r] for r in refs]

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        # Start-up bound: determine_num_blocks profiles a forward pass.
        return self._get([w.run_method.remote(method, *args) for w in self.workers],
                         self.startup_timeout_s)

    def swap_objects(self) -> list[int]:
        return self._get([w.run_method.remote("swap_objects") for w in self.workers])

    def take_expert_tokens(self) -> list[dict[int, list[int]]]:
        # TP rank 0 of each stage counts (every TP rank routes alike)
        return self._get([w.run_method.remote("take_expert_tokens")
                          for w in self.workers[::self.tp]])

    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        return self.collect_step(self.submit_step(out))

    def submit_step(self, out: SchedulerOutput) -> list:
        """Every worker's call for this step, queued behind its earlier ones (an actor runs
        one caller's calls in order), so stage 0 starts the next step while later stages
        still run this one. A step with placeholders (async scheduling) also takes the
        previous step's sampled tokens, as a reference: Ray hands the step to the workers
        as soon as those exist, without a round trip through the engine."""
        import ray

        start = time.perf_counter()
        ref = ray.put(out)  # once; every worker gets the same reference
        self.broadcast_s += time.perf_counter() - start
        args = (ref, self._last_step[self.output_rank]) if out.placeholder_req_ids \
            else (ref,)
        self._last_step = [w.execute_model.remote(*args) for w in self.workers]
        return self._last_step

    def collect_step(self, handle: list) -> ModelRunnerOutput:
        results = self._get(handle)
        out = results[self.output_rank]
        for rank, result in enumerate(results):  # swaps that failed on other ranks
            if rank != self.output_rank and result is not None and result.failed_swaps:
                out.failed_swaps |= result.failed_swaps
        if any(r is not None and r.kv_offloaded for r in results):
            out.kv_offloaded = merge_offloaded([r.kv_offloaded if r is not None else {}
                                                for r in results])
        return out

    def shutdown(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        workers = getattr(self, "workers", [])
        # Best effort throughout: actors may already be dead.
        if workers:
            with contextlib.suppress(Exception):  # the single-node rendezvous file
                ray.get(workers[0].cleanup.remote(), timeout=1)  # 1 s: it may be frozen
        for w in workers:
            with contextlib.suppress(Exception):
                ray.kill(w)
        self.workers = []
        if getattr(self, "pg", None) is not None and getattr(self, "_owns_pg", True):
            with contextlib.suppress(Exception):
                remove_placement_group(self.pg)
            self.pg = None


def bind_collectives_to(ip: str) -> str | None:
    """Make gloo and NCCL use the network interface that holds ``ip`` (this node's address
    as Ray knows it). Left alone, gloo picks the address the hostname resolves to, which on
    many hosts is a loopback address (Debian's ``127.0.1.1``): peers on other nodes then get
    "Connection refused". A ``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME`` set by the user
    wins. Returns the interface, or None when no interface holds ``ip``."""
    import psutil

    iface = next((name for name, addrs in psutil.net_if_addrs().items()
                  if any(a.address == ip for a in addrs)), None)
    if iface is not None:
        for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            os.environ.setdefault(var, iface)
    return iface


def _available_by_node(nodes: list[dict]) -> str:
    """Each live node's address and its free CPU / GPU / custom resources, for errors."""
    import ray

    try:  # per-node availability (Ray >= 2.x); else the totals
        from ray._private.state import available_resources_per_node

        free = available_resources_per_node()
    except Exception:  # noqa: BLE001 - only the message gets poorer
        return str(ray.available_resources())
    parts = []
    for node in nodes:
        res = free.get(node["NodeID"], {})
        shown = {k: v for k, v in res.items()
                 if not k.startswith(("memory", "object_store_memory", "node:__"))}
        parts.append(f"{node.get('NodeManagerAddress')}: {shown}")
    return "; ".join(parts)


def _cluster_has_gpus() -> bool:
    import ray

    return ray.cluster_resources().get("GPU", 0) > 0
