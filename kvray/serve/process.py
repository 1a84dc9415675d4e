"""``kvray serve --ingress process``: the OpenAI app and the engine core in one process.

Ray Serve puts two Ray hops on every streamed token (proxy -> ingress replica -> engine
replica, and back), CPU time taken from the cores the engine steps on: a large share of
the output rate on a small CPU host (benchmarks/RESULTS.md). Here uvicorn
serves :class:`~kvray.serve.openai_app.OpenAIServer` over an in-process
:class:`~kvray.engine.async_engine.AsyncLLM`: no hop at all; Ray is used only for the TP x
PP worker actors (world size > 1). One model replica per process: data parallelism,
autoscaling and KubeRay are the Serve ingress' job.

SIGTERM or Ctrl-C drains like the Serve front end: new requests get 503 + Retry-After,
requests in flight finish for up to ``drain_timeout_s``, the rest end with an error.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import Iterator

import uvicorn

from kvray.config import EngineConfig

logger = logging.getLogger("kvray.serve")
STATS_LOG_PERIOD_S = 10.0


class _DrainingServer(uvicorn.Server):
    """uvicorn, except that SIGTERM / SIGINT start a drain instead of stopping at once
    (uvicorn's own handlers stop accepting, wait, and re-raise the signal at exit)."""

    def __init__(self, config: uvicorn.Config, drain) -> None:
        super().__init__(config)
        self._drain = drain
        self._draining: asyncio.Task | None = None

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        loop = asyncio.get_running_loop()
        signals = (signal.SIGINT, signal.SIGTERM)
        for sig in signals:
            loop.add_signal_handler(sig, self._on_signal)
        try:
            yield
        finally:
            for sig in signals:
                loop.remove_signal_handler(sig)

    def _on_signal(self) -> None:
        if self._draining is None:  # one drain; later signals change nothing
            self._draining = asyncio.get_running_loop().create_task(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        try:
            await self._drain()
        finally:
            self.should_exit = True


async def drain(server, engine, timeout_s: float) -> None:
    """Stop admission, wait up to ``timeout_s`` for the requests in flight, abort the rest."""
    print(f"kvray: draining (up to {timeout_s:g} s; new requests get 503)", flush=True)
    server.begin_drain()
    engine.begin_drain()
    deadline = time.monotonic() + timeout_s
    while server.num_in_flight and time.monotonic() < deadline:
        await asyncio.sleep(0.25)
    if server.num_in_flight:
        print("kvray: drain deadline passed; aborting the requests still running", flush=True)
        await server.abort_all()
        with contextlib.suppress(Exception):
            await engine.abort_all()
    else:
        print("kvray: drained", flush=True)
    await asyncio.sleep(0.6)  # the last chunks (or error events) on their way to clients


async def _log_throughput(engine, name: str, period: float = STATS_LOG_PERIOD_S) -> None:
    """Every ``period`` seconds, one line with the generation rate and the queue."""
    from kvray.engine.stats import throughput_line

    last = None
    while True:
        await asyncio.sleep(period)
        stats = engine.stats()
        total = stats.generation_tokens_total
        if last is not None:
            print(throughput_line(name, (total - last) / period, stats.num_running,
                                  stats.num_waiting), flush=True)
        last = total


async def _announce(http: uvicorn.Server, name: str, host: str, port: int) -> None:
    """The "serving" line, once uvicorn listens (not before: the port may be taken)."""
    while not http.started:
        await asyncio.sleep(0.05)
    print(f"kvray: serving {name} on http://{host}:{port}/v1 (one in-process replica); "
          "Ctrl-C or SIGTERM drains and stops", flush=True)


def serve_in_process(config: EngineConfig, name: str, host: str, port: int,
                     api_key: str | None) -> int:
    """Build the engine here, serve HTTP on ``host:port`` until SIGTERM / Ctrl-C, drain,
    shut the engine (and its workers) down. ``config.model.model`` is the resolved path."""
    import torch

    from kvray.engine.async_engine import AsyncLLM
    from kvray.hardware import available_cores
    from kvray.serve.openai_app import OpenAIServer

    if config.parallel.world_size == 1 and not torch.cuda.is_available():
        torch.set_num_threads(available_cores())
    engine = AsyncLLM(config)
    try:
        server = OpenAIServer(engine, name, engine.engine.max_model_len, api_key,
                              config.server, lora=config.lora, model_head=engine.engine.spec.head)
        uv_config = uvicorn.Config(server.app, host=host, port=port, log_level="warning",
                                   access_log=False, lifespan="off",
                                   timeout_graceful_shutdown=5)

        async def run() -> None:
            http = _DrainingServer(
                uv_config, lambda: drain(server, engine, config.server.drain_timeout_s))
            loop = asyncio.get_running_loop()
            tasks = [loop.create_task(_announce(http, name, host, port))]
            if config.server.log_stats:
                tasks.append(loop.create_task(_log_throughput(engine, name)))
            try:
                await http.serve()
            finally:
                for task in tasks:
                    task.cancel()

        asyncio.run(run())
    finally:
        print("kvray: shutting down", flush=True)
        engine.shutdown()
    return 0
