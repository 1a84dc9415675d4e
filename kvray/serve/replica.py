"""The model replica: one Serve replica hosting an engine core (``AsyncLLM``: scheduler +
executor, its TP x PP workers in their own placement group). More replicas = data
parallelism; Serve routes between them. An ingress reaches it through
:class:`~kvray.serve.transport.ServeClient`; its outputs travel back on carriers
(:class:`~kvray.serve.transport.ChannelEndpoint`) or, without channels, one stream per
request (:meth:`LLMServer.generate`). It publishes its engine's stats to the stats board.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from ray import serve

from kvray.config import EngineConfig
from kvray.outputs import RequestOutput
from kvray.sampling_params import SamplingParams
from kvray.serve.kv_tier import RemoteKVTier
from kvray.serve.lifecycle import ReplicaLifecycle, replica_name, start_engine
from kvray.serve.lora_directory import lora_directory
from kvray.serve.stats_board import STATS_PERIOD_S, report_stats
from kvray.serve.transport import ChannelEndpoint, OutputChannel

logger = logging.getLogger("kvray")


@serve.deployment(max_ongoing_requests=1024, health_check_period_s=5,
                  health_check_timeout_s=30)
class LLMServer(ReplicaLifecycle, ChannelEndpoint):
    """One model replica: the engine core and its step loop. Serve calls ``check_health``
    every few seconds and replaces a replica whose engine loop died or is wedged."""

    async def __init__(self, config: EngineConfig, board_name: str) -> None:
        start = time.perf_counter()
        self.directory = None  # the application's LoRA adapters (LoRA on)
        source = None
        if config.lora.enabled:
            self.directory = lora_directory(board_name, config)
            await self.directory.names.remote()  # a bad lora_modules entry fails the start
            source = self._fetch_adapter
        self.replica_id = replica_name()
        tier = None
        if config.cache.kv_offload_bytes:  # the application's tier, shared by its replicas
            tier = RemoteKVTier(f"{board_name}-kv-tier", config.cache.kv_offload_bytes,
                                self.replica_id)
        self.engine = start_engine(config, source, tier)
        self._channels: dict[str, OutputChannel] = {}  # ingress channel -> its outputs
        self._reporter = asyncio.create_task(
            report_stats(self.engine, self.replica_id, board_name))
        if self.directory is not None:
            self._lora_sync = asyncio.create_task(self._sync_adapters())
        engine_s = self.engine.engine.startup["total_s"]
        logger.info("kvray: replica %s ready in %.1f s (engine %.1f s, the rest Serve's and "
                    "the replica's own)", self.replica_id, time.perf_counter() - start, engine_s)

    # ---- LoRA adapters --------------------------------------------------------------------
    def _fetch_adapter(self, name: str) -> Any:
        """An adapter this replica does not hold, from the application's directory (on the
        engine thread, when a request names it): (LoRARequest, weights reference) or None."""
        import ray

        fetched = ray.get(self.directory.fetch.remote(name))
        return None if fetched is None else (fetched[0], fetched[1][0])

    async def _sync_adapters(self) -> None:
        """Drop adapters the directory no longer lists (unloaded), every stats period."""
        while True:
            with contextlib.suppress(Exception):  # the directory restarting: next time
                names = await self.directory.names.remote()
                if self.engine.engine.loras is not None:
                    self.engine.engine.loras.sync(set(names))
            await asyncio.sleep(STATS_PERIOD_S)

    @serve.multiplexed(max_num_models_per_replica=-1)
    async def _hold_adapter(self, name: str) -> str:
        """Serve's multiplexing records which adapters each replica serves, and routes
        requests for one to a replica that has it (:mod:`kvray.serve.routing`); the engine
        itself takes the adapter from the directory on the request's admission, and its
        registry (``max_cpu_loras``) and slots decide what stays."""
        return name

    async def before_admit(self) -> None:
        name = serve.get_multiplexed_model_id()
        if name:
            await self._hold_adapter(name)

    def record_autoscaling_stats(self) -> dict[str, float]:
        """The engine's load, for the autoscaler (:mod:`kvray.serve.autoscaling`)."""
        from kvray.serve.autoscaling import KV_USAGE, SEQUENCES, WAITING

        stats = self.engine.stats()
        waiting = stats.num_waiting + stats.num_swapped
        return {SEQUENCES: float(stats.num_running + waiting), WAITING: float(waiting),
                KV_USAGE: float(stats.kv_cache_usage)}

    async def health(self) -> None:
        """The ingress' /health probe (same test as check_health)."""
        await self.check_health()

    def model_info(self) -> dict:
        return {"max_model_len": self.engine.engine.max_model_len,
                "head": self.engine.engine.spec.head,
                "labels": list(self.engine.engine.spec.labels),
                "eos_token_ids": list(self.engine.engine.eos_token_ids),
                "sampling_defaults": self.engine.engine.sampling_defaults}

    async def generate(self, request_id: str, prompt: Any, params: SamplingParams,
                       priority: int = 0) -> AsyncIterator[RequestOutput]:
        """One request's outputs on its own stream (one Ray item per output)."""
        await self.before_admit()
        async for out in self.engine.generate(request_id, prompt, params, priority):
            yield out
