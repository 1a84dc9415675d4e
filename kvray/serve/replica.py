"""The model replica: one Serve replica hosting an engine core (``AsyncLLM``: scheduler +
executor, its TP x PP workers in their own placement group). More replicas = data
parallelism; Serve routes between them. An ingress reaches it through
:class:`~kvray.serve.transport.ServeClient`; its outputs travel back on carriers
(:class:`~kvray.serve.transport.ChannelEndpoint`) or, without channels, one stream per
request (:meth:`LLMServer.generate`). It publishes its engine's stats to the stats board.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from ray import serve

from kvray.config import EngineConfig
from kvray.outputs import RequestOutput
from kvray.sampling_params import SamplingParams
from kvray.serve.lifecycle import ReplicaLifecycle, replica_name, start_engine
from kvray.serve.stats_board import report_stats
from kvray.serve.transport import ChannelEndpoint, OutputChannel


@serve.deployment(max_ongoing_requests=1024, health_check_period_s=5,
                  health_check_timeout_s=30)
class LLMServer(ReplicaLifecycle, ChannelEndpoint):
    """One model replica: the engine core and its step loop. Serve calls ``check_health``
    every few seconds and replaces a replica whose engine loop died or is wedged."""

    async def __init__(self, config: EngineConfig, board_name: str) -> None:
        self.engine = start_engine(config)
        self.replica_id = replica_name()
        self._channels: dict[str, OutputChannel] = {}  # ingress channel -> its outputs
        self._reporter = asyncio.create_task(
            report_stats(self.engine, self.replica_id, board_name))

    async def health(self) -> None:
        """The ingress' /health probe (same test as check_health)."""
        await self.check_health()

    def model_info(self) -> dict:
        return {"max_model_len": self.engine.engine.max_model_len}

    async def generate(self, request_id: str, prompt: Any, params: SamplingParams,
                       priority: int = 0) -> AsyncIterator[RequestOutput]:
        """One request's outputs on its own stream (one Ray item per output)."""
        async for out in self.engine.generate(request_id, prompt, params, priority):
            yield out
