"""Ray Serve application: an OpenAI ingress in front of model replicas.

``LLMServer`` replicas each host an engine core (``AsyncLLM``: scheduler + executor, its TP x
PP workers in their own placement group) and stream per-request outputs back. More
replicas = data parallelism; Serve routes between them. ``OpenAIIngress`` serves the HTTP
API. Replicas publish engine stats to a small named actor so that one ``/metrics`` scrape
sees every replica.

``ingress="replica"`` (one model replica) deploys the OpenAI app inside the model replica
instead (``LLMServerIngress``, still named ``LLMServer``): Serve's proxy hands HTTP straight
to the process that runs the engine, one Ray hop per streamed token fewer. The price is
isolation: a killed replica process takes its open streams with it (the proxy cuts them),
where the separate ingress would end them with an error event.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import time
import uuid
from typing import Any

from fastapi import FastAPI
from ray import serve

from kvray.actors.executor import executor_backend
from kvray.actors.placement import worker_bundles
from kvray.config import ConfigError, config_from_flat
from kvray.errors import EngineUnavailableError
from kvray.outputs import RequestOutput
from kvray.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger("kvray.serve")
STATS_PERIOD_S = 0.5
STATS_NAMESPACE = "kvray"
HEALTH_TIMEOUT_S = 5.0
INGRESS_QUEUE = 8192  # requests Serve's proxy may queue for the ingress (see build_app)
INGRESS_KINDS = ("separate", "replica")
CARRIER_IDLE_S = 2.0  # a channel's carrier ends after this long with no request
UNCARRIED_CHANNEL_S = 60.0  # a channel whose carrier never came is dropped after this long
CARRIER_RETRIES = 3  # tries to open a carrier on the replica that admitted a request


def _stats_board(name: str):
    import ray

    @ray.remote(num_cpus=0)
    class StatsBoard:
        """Latest engine stats of each model replica."""

        def __init__(self) -> None:
            self.stats: dict[str, tuple[float, dict]] = {}

        def report(self, replica: str, stats: dict) -> None:
            self.stats[replica] = (time.monotonic(), stats)

        def snapshot(self, max_age_s: float = 10.0) -> list[tuple[str, dict]]:
            cutoff = time.monotonic() - max_age_s  # a dead replica drops out
            return [(r, s) for r, (t, s) in self.stats.items() if t >= cutoff]

    # Restarted by Ray if its process dies (the stats refill within STATS_PERIOD_S);
    # callers also look it up again when a call fails.
    return StatsBoard.options(name=name, namespace=STATS_NAMESPACE, get_if_exists=True,
                              lifetime="detached", max_restarts=-1).remote()


def check_ingress(ingress: str, num_replicas: int) -> None:
    """Raise ConfigError unless ``ingress`` is a known kind that fits ``num_replicas``."""
    if ingress not in INGRESS_KINDS:
        raise ConfigError(f"ingress = {ingress!r}: must be one of {', '.join(INGRESS_KINDS)}")
    if ingress == "replica" and num_replicas != 1:
        raise ConfigError(f"ingress = 'replica' serves one model replica (num_replicas = "
                          f"{num_replicas}); use ingress = 'separate' for data parallelism")


def _start_engine(engine_config: dict):
    """The replica's engine core (``AsyncLLM``), torch's threads set for an in-replica
    engine (Ray starts actors with OMP_NUM_THREADS=1)."""
    import torch

    from kvray.engine.async_engine import AsyncLLM
    from kvray.hardware import available_cores

    config = config_from_flat(engine_config)
    if config.parallel.world_size == 1 and not torch.cuda.is_available():
        torch.set_num_threads(available_cores())
    return AsyncLLM(config)


def _replica_name() -> str:
    replica_id = getattr(serve.get_replica_context(), "replica_id", None)
    return getattr(replica_id, "unique_id", None) or uuid.uuid4().hex[:8]


async def _report_stats(engine, replica: str, board_name: str) -> None:
    """Publish the engine's stats to the board every STATS_PERIOD_S, forever."""
    board = _stats_board(board_name)
    while True:
        try:
            await board.report.remote(replica, vars(engine.stats()).copy())
        except Exception:  # the board died: look it up (or start it) again
            with contextlib.suppress(Exception):
                board = _stats_board(board_name)
        await asyncio.sleep(STATS_PERIOD_S)


def _api_key(api_key: str | None, api_key_file: str | None) -> str | None:
    """The key given, else the first line of ``api_key_file`` (read in the replica: the
    Secret is mounted there), else ``KVRAY_API_KEY`` in the replica's environment."""
    import os
    from pathlib import Path

    if api_key is None and api_key_file:
        api_key = Path(api_key_file).read_text().strip().splitlines()[0].strip()
    if api_key is None:
        api_key = os.environ.get("KVRAY_API_KEY") or None
    return api_key


@serve.deployment(max_ongoing_requests=1024, health_check_period_s=5,
                  health_check_timeout_s=30)
class LLMServer:
    """One model replica: the engine core and its step loop. Serve calls ``check_health``
    every few seconds and replaces a replica whose engine loop died or is wedged."""

    async def __init__(self, engine_config: dict, board_name: str) -> None:
        self.engine = _start_engine(engine_config)
        self.replica_id = _replica_name()
        self._channels: dict[str, _OutputChannel] = {}  # ingress channel -> its outputs
        self._reporter = asyncio.create_task(
            _report_stats(self.engine, self.replica_id, board_name))

    async def check_health(self) -> None:
        """Serve's probe: raises when the engine loop is dead or wedged."""
        await self.engine.check_health()

    async def health(self) -> None:
        """The ingress' /health probe (same test as check_health)."""
        await self.engine.check_health()

    def begin_drain(self) -> None:
        self.engine.begin_drain()

    async def abort_all(self) -> int:
        return await self.engine.abort_all()

    def model_info(self) -> dict:
        engine = self.engine.engine
        return {"max_model_len": engine.max_model_len}

    async def generate(self, request_id: str, prompt: Any, params: SamplingParams,
                       priority: int = 0):
        """One request's outputs on its own stream (one Ray item per output)."""
        async for out in self.engine.generate(request_id, prompt, params, priority):
            yield out

    def _channel(self, channel: str) -> _OutputChannel:
        ch = self._channels.get(channel)
        if ch is None:
            ch = self._channels[channel] = _OutputChannel()
        return ch

    async def submit(self, channel: str, request_id: str, prompt: Any, params: SamplingParams,
                     priority: int = 0):
        """Admit a request whose outputs travel on ``channel``'s carrier (:meth:`carry`).
        Raises what admission raises; once admitted, yields this replica's id and then
        nothing: the call stays open while the request runs, so that cancelling it (the
        client went away) aborts the request and a dead replica fails it at the caller."""
        stream = await self.engine.open_stream(request_id, prompt, params, priority)
        ch = self._channel(channel)
        ch.requests.add(request_id)
        try:
            yield self.replica_id
            async for out in stream:
                ch.push(request_id, out)
        except Exception as err:  # past its deadline, or the engine failed under it
            ch.push(request_id, err)
        finally:
            ch.requests.discard(request_id)
            await stream.aclose()
            if not ch.carried and not ch.requests:  # its ingress may have died before carrying
                asyncio.ensure_future(self._drop_uncarried(channel, ch))

    async def carry(self, channel: str, replica: str | None = None):
        """``channel``'s carrier: every output of its requests on this replica, one Ray
        item per engine step (a list of (request id, output or error)) instead of one per
        request per step. The first item is this replica's id. Ends at once when the
        channel has a carrier already, and after CARRIER_IDLE_S with no request (Serve
        waits for open calls when it stops a replica); ``replica`` is for the router."""
        ch = self._channel(channel)
        if ch.carried:
            return
        ch.carried = True
        try:
            yield self.replica_id
            while True:
                try:
                    await asyncio.wait_for(ch.ready.wait(), CARRIER_IDLE_S)
                except TimeoutError:
                    if not ch.requests and not ch.pending:
                        return
                    continue
                await asyncio.sleep(0)  # the rest of this step's outputs land meanwhile
                ch.ready.clear()
                batch, ch.pending = ch.pending, []
                if batch:
                    yield batch
        finally:
            ch.carried = False
            if ch.requests:  # cancelled or failed mid-stream (the ingress died): no reader
                asyncio.ensure_future(self._abort_quietly(list(ch.requests)))
            # Nothing reads this channel any more (a new carrier starts a new one): drop
            # what it holds and what its aborted requests push later, or a dead ingress'
            # channel would stay here with its last outputs for good.
            self._drop_channel(channel, ch)

    def _drop_channel(self, channel: str, ch: _OutputChannel) -> None:
        """Close ``ch`` and forget it, unless a newer channel of that name replaced it."""
        ch.close()
        if self._channels.get(channel) is ch:
            del self._channels[channel]

    async def _drop_uncarried(self, channel: str, ch: _OutputChannel) -> None:
        """Drop ``ch`` if no carrier has come for it in UNCARRIED_CHANNEL_S (the ingress
        that admitted its requests died before opening one); a carrier that comes reads it
        (a short request can end before its ingress opens the carrier)."""
        await asyncio.sleep(UNCARRIED_CHANNEL_S)
        if self._channels.get(channel) is ch and not ch.carried and not ch.requests:
            self._drop_channel(channel, ch)

    async def _abort_quietly(self, request_ids: list[str]) -> None:
        with contextlib.suppress(Exception):  # the engine may be stopping with the replica
            await self.engine.abort(request_ids, "the server lost this request's output "
                                    "stream; retry it")

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.engine.shutdown()


class _OutputChannel:
    """One ingress' outputs on a model replica, gathered between two carrier items."""

    def __init__(self) -> None:
        self.pending: list[tuple[str, Any]] = []
        self.ready = asyncio.Event()
        self.requests: set[str] = set()
        self.carried = False  # a carrier call is open
        self.closed = False  # its carrier ended: nothing will read it

    def push(self, request_id: str, item: Any) -> None:
        if self.closed:
            return
        self.pending.append((request_id, item))
        self.ready.set()

    def close(self) -> None:
        self.closed = True
        self.pending.clear()


class _ServeClient:
    """The engine-client interface of OpenAIServer, over a Serve handle to LLMServer.

    With ``channels`` (the default), each request's outputs come back on its model
    replica's carrier for this ingress (one Ray item per engine step for all of them:
    ``LLMServer.carry``), while the request's own call only admits it and stays open, so
    that cancelling it aborts the request and a dead replica fails it. Without, each
    request streams its outputs on its own call (one Ray item per output)."""

    def __init__(self, handle, tokenizer, board_name: str, channels: bool = True) -> None:
        self.handle, self.tokenizer, self.board_name = handle, tokenizer, board_name
        self.board = _stats_board(board_name)
        self._stats: list[tuple[str, dict]] = []
        self.channels = channels
        self.channel = uuid.uuid4().hex  # this ingress' outputs on every model replica
        self._queues: dict[str, asyncio.Queue] = {}  # request id -> outputs to hand out
        self._on_replica: dict[str, set[str]] = {}  # replica id -> its requests from here
        self._carriers: dict[str, asyncio.Task] = {}  # replica id -> the task reading it

    async def refresh_stats(self) -> None:
        while True:
            try:
                self._stats = await self.board.snapshot.remote()
            except Exception:  # the board died: look it up (or start it) again
                with contextlib.suppress(Exception):
                    self.board = _stats_board(self.board_name)
            await asyncio.sleep(STATS_PERIOD_S)

    def engine_stats(self) -> list[tuple[str, dict]]:
        return self._stats

    async def check_health(self) -> None:
        """One engine replica's health, bounded: a replica that does not answer in
        HEALTH_TIMEOUT_S counts as unhealthy."""
        await asyncio.wait_for(self.handle.health.remote(), HEALTH_TIMEOUT_S)

    async def generate(self, request_id: str, prompt: Any, params: SamplingParams,
                       priority: int = 0):
        if not self.channels:
            async for out in self._generate_streamed(request_id, prompt, params, priority):
                yield out
            return
        q: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = q
        # Made outside the HTTP request's Serve context, like the carrier: Serve would make
        # it that request's child, and a custom router (the carrier's, which Serve then
        # uses for every call) matches calls to replicas by the parent's id, which the
        # calls for one request's several prompts share. The client going away still
        # aborts it: ``finally`` below cancels it.
        call = contextvars.Context().run(
            self.handle.options(stream=True).submit.remote,
            self.channel, request_id, prompt, params, priority)
        replica = watcher = None
        finished = False
        try:
            replica = await call.__anext__()  # admitted; admission errors raise here
            self._on_replica.setdefault(replica, set()).add(request_id)
            if replica not in self._carriers:
                self._start_carrier(replica)
            watcher = asyncio.create_task(self._watch(call, q))
            fold = params.output_kind is RequestOutputKind.DELTA
            while not finished:
                item = await q.get()
                # a lagging consumer gets what queued up as one output (deltas add up)
                while fold and not q.empty() and not isinstance(item, BaseException):
                    later = q.get_nowait()
                    if isinstance(later, BaseException):
                        q.put_nowait(later)  # after the outputs before it
                        break
                    item.add(later)
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            self._queues.pop(request_id, None)
            if replica is not None:
                self._on_replica.get(replica, set()).discard(request_id)
            if watcher is not None:
                watcher.cancel()
            if not finished:  # the client went away (or an error): abort it there too
                call.cancel()

    @staticmethod
    async def _watch(call, q: asyncio.Queue) -> None:
        """Wait out a request's open call; its failure (the replica died) is the
        request's error."""
        try:
            async for _ in call:
                pass
        except Exception as err:
            q.put_nowait(err)

    def _start_carrier(self, replica: str) -> None:
        # In a context of its own: a call made under an HTTP request's context is that
        # request's child, and Serve cancels it when that client goes away.
        self._carriers[replica] = asyncio.create_task(self._carry(replica),
                                                      context=contextvars.Context())

    async def _carry(self, replica: str) -> None:
        """Read ``replica``'s carrier for this ingress and hand each output to its
        request; when it fails, the requests still waiting on it fail with it."""
        error: BaseException | None = None
        try:
            for attempt in range(CARRIER_RETRIES):
                call = self.handle.options(stream=True).carry.remote(self.channel,
                                                                     replica=replica)
                landed = await call.__anext__()
                if landed == replica:
                    break
                call.cancel()  # routed elsewhere: the replica is full or gone
                await asyncio.sleep(0.2 * (attempt + 1))
            else:
                raise EngineUnavailableError("the model replica serving this request "
                                             "cannot be reached; retry it")
            async for batch in call:
                for request_id, item in batch:
                    q = self._queues.get(request_id)
                    if q is not None:
                        q.put_nowait(item)
        except StopAsyncIteration:  # a carrier of this channel was open there already
            error = EngineUnavailableError("lost the model replica's outputs; retry it")
        except BaseException as err:  # failed, or this ingress is stopping (cancelled)
            error = err
        if self._carriers.get(replica) is asyncio.current_task():
            del self._carriers[replica]
        waiting = self._on_replica.get(replica, set())
        if error is None and waiting:  # ended idle just as a request came: carry on
            self._start_carrier(replica)
            return
        cancelled = isinstance(error, asyncio.CancelledError)
        if cancelled:
            error = EngineUnavailableError("the server stopped reading the model "
                                           "replica's outputs; retry it")
        for request_id in list(waiting):
            q = self._queues.get(request_id)
            if q is not None:
                q.put_nowait(error)
        if cancelled:
            raise asyncio.CancelledError

    async def _generate_streamed(self, request_id: str, prompt: Any, params: SamplingParams,
                                 priority: int = 0):
        gen = self.handle.options(stream=True).generate.remote(request_id, prompt, params,
                                                               priority)
        finished = False
        try:
            async for out in gen:
                out: RequestOutput
                finished = out.finished
                yield out
        finally:
            if not finished:  # the client went away: cancel, which aborts the request
                gen.cancel()


@serve.deployment(max_ongoing_requests=2048)
@serve.ingress()  # the app is built per replica, by __serve_build_asgi_app__
class OpenAIIngress:
    async def __init__(self, llm_handle, model_path: str, model_name: str,
                       api_key: str | None, engine_config: dict, board_name: str,
                       api_key_file: str | None = None, channels: bool = True) -> None:
        from kvray.serve.openai_app import OpenAIServer
        from kvray.tokenizer import load_tokenizer

        api_key = _api_key(api_key, api_key_file)
        config = config_from_flat(engine_config)
        tokenizer = load_tokenizer(model_path, config.model.tokenizer)
        client = _ServeClient(llm_handle, tokenizer, board_name, channels)
        info = await llm_handle.model_info.remote()
        self.server = OpenAIServer(client, model_name, info["max_model_len"], api_key,
                                   config.server)
        self._refresher = asyncio.create_task(client.refresh_stats())

    def __serve_build_asgi_app__(self) -> FastAPI:
        return self.server.app

    def begin_drain(self) -> None:
        """Stop admission here (503 + Retry-After; /health 503); in flight goes on."""
        self.server.begin_drain()

    async def abort_all(self) -> None:
        """End every request this ingress has in flight with an error."""
        await self.server.abort_all()

    def num_in_flight(self) -> int:
        """Engine streams this ingress has open (a drain is done at 0)."""
        return self.server.num_in_flight


@serve.deployment(max_ongoing_requests=2048, health_check_period_s=5,
                  health_check_timeout_s=30)
@serve.ingress()  # the app is built per replica, by __serve_build_asgi_app__
class LLMServerIngress:
    """The OpenAI app and the engine core in one replica (``ingress="replica"``): what
    ``OpenAIIngress`` and ``LLMServer`` do, without the Ray hop between them. Serve
    replaces the replica when its engine loop dies or is wedged, as for ``LLMServer``."""

    async def __init__(self, engine_config: dict, model_path: str, model_name: str,
                       api_key: str | None, board_name: str,
                       api_key_file: str | None = None) -> None:
        from kvray.serve.openai_app import OpenAIServer

        self.engine = _start_engine(engine_config)
        self.server = OpenAIServer(self.engine, model_name, self.engine.engine.max_model_len,
                                   _api_key(api_key, api_key_file), self.engine.config.server)
        # `kvray serve`'s throughput line and any other reader of the board see it too.
        self._reporter = asyncio.create_task(
            _report_stats(self.engine, _replica_name(), board_name))

    def __serve_build_asgi_app__(self) -> FastAPI:
        return self.server.app

    async def check_health(self) -> None:
        """Serve's probe: raises when the engine loop is dead or wedged."""
        await self.engine.check_health()

    def begin_drain(self) -> None:
        """Stop admission (503 + Retry-After; /health 503); in flight goes on."""
        self.server.begin_drain()
        self.engine.begin_drain()

    async def abort_all(self) -> None:
        """End every request in flight with an error."""
        await self.server.abort_all()
        await self.engine.abort_all()

    def num_in_flight(self) -> int:
        """Streams open (a drain is done at 0)."""
        return self.server.num_in_flight

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.engine.shutdown()


def build_app(engine_config: dict, model_path: str, model_name: str,
              api_key: str | None = None, num_replicas: int = 1, app_name: str = "kvray",
              api_key_file: str | None = None, use_gpu: bool | None = None,
              ingress: str = "separate"):
    """The Serve application graph for one model. Serve's own queues are bounded
    (``max_queued_requests``: beyond, callers get 503); the engine admits by sequences.
    ``use_gpu``: each worker (or the replica itself, TP x PP = 1) reserves a GPU; None =
    whether the cluster has GPUs now. ``ingress``: ``separate`` (an OpenAI ingress
    deployment in front of the model replicas) or ``replica`` (the app inside the one model
    replica: one Ray hop per streamed token fewer)."""
    check_ingress(ingress, num_replicas)
    config = config_from_flat(engine_config)
    board = f"kvray-stats-{app_name}"
    drain = config.server.drain_timeout_s
    queue = config.server.max_waiting + config.scheduler.max_num_seqs
    options: dict[str, Any] = {"num_replicas": num_replicas, "max_queued_requests": queue,
                               "graceful_shutdown_timeout_s": drain + 5}
    if use_gpu is None:  # decided now: say it explicitly when GPU nodes join later
        import ray

        use_gpu = ray.is_initialized() and ray.cluster_resources().get("GPU", 0) > 0
    if executor_backend(config) == "ray":
        # The replica's bundle, then one per worker: Serve reserves the whole replica
        # (with STRICT_SPREAD the replica's own bundle needs a node of its own too).
        options["placement_group_bundles"] = [{"CPU": 1}, *worker_bundles(config, use_gpu)]
        options["placement_group_strategy"] = config.parallel.placement_strategy
    elif use_gpu:  # the engine runs in the replica itself: it holds the GPU
        options["ray_actor_options"] = {"num_cpus": 1, "num_gpus": 1}
    try:  # Ray >= 2.5x: the proxy's own refusals say when to retry
        from ray.serve.config import BackpressureConfig

        backpressure = {"backpressure_config": BackpressureConfig(status_code=503,
                                                                  retry_after_s=1)}
    except ImportError:
        backpressure = {}
    if ingress == "replica":  # HTTP to this replica: the ingress' queue bound and drain time
        options.update(max_queued_requests=INGRESS_QUEUE, graceful_shutdown_timeout_s=drain + 10,
                       **backpressure)
        return LLMServerIngress.options(name="LLMServer", **options).bind(
            engine_config, model_path, model_name, api_key, board, api_key_file)
    # Outputs on one carrier per model replica (see _ServeClient), which names its replica:
    # Serve routes by that name, however many replicas a config or autoscaling makes.
    try:
        from ray.serve.config import RequestRouterConfig

        from kvray.serve.routing import ReplicaTargetRouter
    except ImportError:  # a Ray without custom routers: one stream per request
        channels = False
    else:
        channels = True
        options["request_router_config"] = RequestRouterConfig(
            request_router_class=ReplicaTargetRouter)
    llm = LLMServer.options(**options).bind(engine_config, board)
    # The ingress answers every request at once (admitted, or refused with OpenAI's JSON),
    # so its queue only holds a burst while Serve's router assigns it: bounded, but far
    # above what the engine admits, so that refusals come from kvray, not the proxy.
    front = {"max_queued_requests": INGRESS_QUEUE, "graceful_shutdown_timeout_s": drain + 10,
             **backpressure}
    return OpenAIIngress.options(**front).bind(
        llm, model_path, model_name, api_key, engine_config, board, api_key_file, channels)
