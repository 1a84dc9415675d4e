"""What every kvray Serve replica answers besides requests: Serve's health probe and the
drain calls of ``kvray serve`` (stop admitting, count what is in flight, end the rest),
plus starting the engine core a replica hosts and naming the replica."""

from __future__ import annotations

import contextlib
import uuid
from typing import TYPE_CHECKING, Any

from ray import serve

from kvray.config import EngineConfig

if TYPE_CHECKING:
    from kvray.engine.async_engine import AsyncLLM
    from kvray.serve.openai_app import OpenAIServer


def start_engine(config: EngineConfig, lora_source: Any = None,
                 kv_tier: Any = None) -> AsyncLLM:
    """A replica's engine core (``AsyncLLM``), torch's threads set for an in-replica
    engine (Ray starts actors with OMP_NUM_THREADS=1); ``lora_source`` and ``kv_tier`` as
    :class:`~kvray.engine.llm_engine.LLMEngine` takes them."""
    import torch

    from kvray.engine.async_engine import AsyncLLM
    from kvray.hardware import available_cores

    if config.parallel.world_size == 1 and not torch.cuda.is_available():
        torch.set_num_threads(available_cores())
    return AsyncLLM(config, lora_source, kv_tier)


def replica_name() -> str:
    """This Serve replica's unique id (a random one outside Serve)."""
    replica_id = getattr(serve.get_replica_context(), "replica_id", None)
    return getattr(replica_id, "unique_id", None) or uuid.uuid4().hex[:8]


class ReplicaLifecycle:
    """Health, drain and abort for a replica that serves the OpenAI app (``server``), hosts
    an engine core (``engine``), or both; each call goes to the app first, then the engine."""

    server: OpenAIServer | None = None
    engine: AsyncLLM | None = None

    async def check_health(self) -> None:
        """Serve's probe: raises when the engine loop is dead or wedged. Serve replaces a
        replica that fails it."""
        if self.engine is not None:
            await self.engine.check_health()

    def begin_drain(self) -> None:
        """Stop admission (503 + Retry-After; /health 503); requests in flight go on."""
        if self.server is not None:
            self.server.begin_drain()
        if self.engine is not None:
            self.engine.begin_drain()

    async def abort_all(self) -> int:
        """End every request in flight with an error; how many the engine ended (0 for an
        ingress without one)."""
        if self.server is not None:
            await self.server.abort_all()
        return 0 if self.engine is None else await self.engine.abort_all()

    def num_in_flight(self) -> int:
        """Streams open: the app's when it serves one, else the engine's (a drain is done
        at 0)."""
        if self.server is not None:
            return self.server.num_in_flight
        return 0 if self.engine is None else self.engine.num_in_flight()

    def __del__(self) -> None:
        if self.engine is not None:
            with contextlib.suppress(Exception):
                self.engine.shutdown()
