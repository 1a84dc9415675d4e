"""How a request's outputs travel from a model replica to the ingress that admitted it.

Each request has its own call (``submit``) that admits it (its errors raise there), then
stays open while the request runs: cancelling it (the client went away) aborts the request,
and a dead replica fails it at the caller. Its outputs travel instead on the replica's
*carrier* for that ingress (``carry``): one Ray item per engine step for all of the
ingress' requests there, instead of one per request per step. A custom request router
(:mod:`kvray.serve.routing`) sends each carrier call to the replica it names.

The replica half (:class:`ChannelEndpoint`) keeps one :class:`OutputChannel` per ingress;
a channel is dropped with its carrier, or UNCARRIED_CHANNEL_S after its last request when
no carrier came (the ingress died first). The ingress half is :class:`ServeClient`.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from kvray.engine.stream_fold import fold_queued
from kvray.errors import EngineUnavailableError, InvalidRequestError, NotFoundError
from kvray.outputs import RequestOutput
from kvray.sampling_params import RequestOutputKind, SamplingParams
from kvray.serve.stats_board import StatsReader

if TYPE_CHECKING:
    from kvray.engine.async_engine import AsyncLLM

HEALTH_TIMEOUT_S = 5.0
CARRIER_IDLE_S = 2.0  # a channel's carrier ends after this long with no request
UNCARRIED_CHANNEL_S = 60.0  # a channel whose carrier never came is dropped after this long
CARRIER_RETRIES = 3  # tries to open a carrier on the replica that admitted a request
LORA_NAMES_TTL_S = 1.0  # an ingress' copy of the adapters served is read again after this


async def first_item(call: Any) -> Any:
    """The first item of a streaming Serve ``call``; cancelled before it came, the call is
    cancelled once it has.

    Serve can lose a cancel that lands while it assigns the call to a replica: the
    router's result is dropped as cancelled while the replica already runs the call,
    which then runs to its end unseen (a request that decodes to max_tokens for a
    client long gone). So the first item is awaited shielded, and only a call that
    has reached its replica is cancelled, where ``cancel`` stops it."""
    first = asyncio.ensure_future(call.__anext__())
    try:
        return await asyncio.shield(first)
    except asyncio.CancelledError:
        def cancel_when_placed(done: asyncio.Future) -> None:
            if not done.cancelled():
                done.exception()  # retrieved: an admission error has no reader now
            call.cancel()

        first.add_done_callback(cancel_when_placed)
        raise


class OutputChannel:
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


class ChannelEndpoint:
    """The model replica's half: ``submit`` and ``carry`` over its ``engine``, one channel
    per ingress in ``_channels`` (set up by the replica's constructor)."""

    engine: AsyncLLM
    replica_id: str
    _channels: dict[str, OutputChannel]

    async def before_admit(self) -> None:
        """Called in ``submit`` before the request is admitted (the replica notes the
        request's LoRA adapter there)."""

    def _channel(self, channel: str) -> OutputChannel:
        ch = self._channels.get(channel)
        if ch is None:
            ch = self._channels[channel] = OutputChannel()
        return ch

    async def submit(self, channel: str, request_id: str, prompt: Any, params: SamplingParams,
                     priority: int = 0) -> AsyncIterator[str]:
        """Admit a request whose outputs travel on ``channel``'s carrier (:meth:`carry`).
        Raises what admission raises; once admitted, yields this replica's id and then
        nothing: the call stays open while the request runs, so that cancelling it (the
        client went away) aborts the request and a dead replica fails it at the caller."""
        await self.before_admit()
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

    async def carry(self, channel: str, replica: str | None = None) -> AsyncIterator[Any]:
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

    def _drop_channel(self, channel: str, ch: OutputChannel) -> None:
        """Close ``ch`` and forget it, unless a newer channel of that name replaced it."""
        ch.close()
        if self._channels.get(channel) is ch:
            del self._channels[channel]

    async def _drop_uncarried(self, channel: str, ch: OutputChannel) -> None:
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


class ServeClient:
    """The ingress' half: the engine-client interface of OpenAIServer, over a Serve handle
    to the model replicas.

    With ``channels`` (the default), each request's outputs come back on its model
    replica's carrier for this ingress; without (a Ray without custom routers), each
    request streams its outputs on its own call (one Ray item per output)."""

    def __init__(self, handle: Any, tokenizer: Any, board_name: str,
                 channels: bool = True, lora_directory: Any = None) -> None:
        self.handle, self.tokenizer = handle, tokenizer
        self.lora_directory = lora_directory  # the application's adapters (LoRA on)
        self._lora_names: set[str] = set()  # the directory's names, as of _lora_checked
        self._lora_checked = 0.0
        self.stats = StatsReader(board_name)
        self.channels = channels
        self.channel = uuid.uuid4().hex  # this ingress' outputs on every model replica
        self._queues: dict[str, asyncio.Queue] = {}  # request id -> outputs to hand out
        self._on_replica: dict[str, set[str]] = {}  # replica id -> its requests from here
        self._carriers: dict[str, asyncio.Task] = {}  # replica id -> the task reading it

    def engine_stats(self) -> list[tuple[str, dict]]:
        return self.stats.latest

    def _options(self, prompt: Any) -> Any:
        """The handle for a request: streaming, and for a LoRA adapter's request Serve's
        multiplexed model id, so that a replica holding the adapter takes it."""
        name = prompt.get("lora_name") if isinstance(prompt, dict) else None
        if name:
            return self.handle.options(stream=True, multiplexed_model_id=name)
        return self.handle.options(stream=True)

    # ---- LoRA adapters: the application's directory (kvray.serve.lora_directory) -----------
    async def _check_adapter(self, prompt: Any) -> None:
        """404 for a request naming an adapter the application does not serve: checked
        against the directory's names, read again when older than LORA_NAMES_TTL_S or
        missing the name (an adapter unloaded through another ingress replica may pass
        for that long; the replicas drop it within a stats period too)."""
        name = prompt.get("lora_name") if isinstance(prompt, dict) else None
        if not name or self.lora_directory is None:
            return
        stale = time.monotonic() - self._lora_checked > LORA_NAMES_TTL_S
        if name not in self._lora_names or stale:
            await self.list_loras()
        if name not in self._lora_names:
            raise NotFoundError(f"the model `{name}` does not exist", "model")

    async def list_loras(self) -> list[str]:
        if self.lora_directory is None:
            return []
        names = await self.lora_directory.names.remote()
        self._lora_names, self._lora_checked = set(names), time.monotonic()
        return names

    async def load_lora(self, name: str, path: str) -> None:
        await self._directory().load.remote(name, path)
        self._lora_names.add(name)

    async def unload_lora(self, name: str) -> bool:
        self._lora_names.discard(name)
        return await self._directory().unload.remote(name)

    def _directory(self) -> Any:
        if self.lora_directory is None:
            raise InvalidRequestError("this server runs no LoRA adapters (start it with "
                                      "enable_lora)", "lora_name")
        return self.lora_directory

    async def check_health(self) -> None:
        """One engine replica's health, bounded: a replica that does not answer in
        HEALTH_TIMEOUT_S counts as unhealthy."""
        await asyncio.wait_for(self.handle.health.remote(), HEALTH_TIMEOUT_S)

    async def generate(self, request_id: str, prompt: Any, params: SamplingParams,
                       priority: int = 0) -> AsyncIterator[RequestOutput]:
        """The request's outputs, as the model replica's engine yields them."""
        if not self.channels:
            await self._check_adapter(prompt)
            async for out in self._generate_streamed(request_id, prompt, params, priority):
                yield out
            return
        await self._check_adapter(prompt)
        q: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = q
        # Made outside the HTTP request's Serve context, like the carrier: Serve would make
        # it that request's child, and a custom router (the carrier's, which Serve then
        # uses for every call) matches calls to replicas by the parent's id, which the
        # calls for one request's several prompts share. The client going away still
        # aborts it: ``finally`` below cancels it.
        call = contextvars.Context().run(
            self._options(prompt).submit.remote,
            self.channel, request_id, prompt, params, priority)
        replica = watcher = None
        finished = False
        try:
            replica = await first_item(call)  # admitted; admission errors raise here
            self._on_replica.setdefault(replica, set()).add(request_id)
            if replica not in self._carriers:
                self._start_carrier(replica)
            watcher = asyncio.create_task(self._watch(call, q))
            delta = params.output_kind is RequestOutputKind.DELTA
            while not finished:
                item = await q.get()
                if delta:  # a lagging consumer gets what queued up as one output
                    item, error = fold_queued(item, q, delta=True)
                    if error is not None:
                        q.put_nowait(error)  # after the outputs before it
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
            if not finished and replica is not None:  # the client went away (or an
                call.cancel()  # error): abort it there too (before: first_item's part)

    @staticmethod
    async def _watch(call: Any, q: asyncio.Queue) -> None:
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

    async def _open_carrier(self, replica: str) -> Any:
        """A carrier call that landed on ``replica`` (the router sends it elsewhere when
        that replica is full or gone: then try again, a few times)."""
        for attempt in range(CARRIER_RETRIES):
            call = self.handle.options(stream=True).carry.remote(self.channel,
                                                                 replica=replica)
            if await call.__anext__() == replica:
                return call
            call.cancel()
            await asyncio.sleep(0.2 * (attempt + 1))
        raise EngineUnavailableError("the model replica serving this request cannot be "
                                     "reached; retry it")

    async def _carry(self, replica: str) -> None:
        """Read ``replica``'s carrier for this ingress and hand each output to its
        request; when it fails, the requests still waiting on it fail with it."""
        error: BaseException | None = None
        try:
            async for batch in await self._open_carrier(replica):
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
                                 priority: int = 0) -> AsyncIterator[RequestOutput]:
        gen = self._options(prompt).generate.remote(request_id, prompt, params, priority)
        finished = started = False
        try:
            out = await first_item(gen)
            started = True
            while True:
                finished = out.finished
                yield out
                out = await gen.__anext__()
        except StopAsyncIteration:
            return
        finally:
            if not finished and started:  # the client went away: cancel, which aborts
                gen.cancel()  # the request (before its first output: first_item's part)
