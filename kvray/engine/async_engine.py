"""AsyncLLM: the engine core's step loop on a background thread, fed by asyncio callers.

The server's request handlers run on an event loop; the engine steps for ~100 ms at a time.
One thread builds and owns the ``LLMEngine`` and runs ``step()`` while there is work;
handlers talk to it through a command queue and receive per-request output streams. A
handler that is cancelled (client disconnected) aborts its request, freeing its blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import AsyncGenerator, AsyncIterator
from concurrent.futures import Future
from typing import Any

from kvray.config import EngineConfig
from kvray.engine.llm_engine import LLMEngine, PromptType
from kvray.engine.stream_fold import fold_queued
from kvray.errors import (
    EngineUnavailableError,
    InvalidRequestError,
    KVRayError,
    RequestTimeoutError,
    ServerBusyError,
)
from kvray.outputs import RequestOutput
from kvray.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)
_IDLE_WAIT_S = 0.5


class EngineLoopDead(EngineUnavailableError):
    """The engine loop stopped, or a step failed under the request (a worker died or
    stopped answering): the request was aborted."""


class AsyncLLM:
    """Admission (``max_waiting`` sequences; none while draining or rebuilding), per-request
    deadlines and health on top of the engine thread."""

    def __init__(self, config: EngineConfig, lora_source: Any = None,
                 kv_tier: Any = None) -> None:
        """``lora_source``, ``kv_tier``: see :class:`~kvray.engine.llm_engine.LLMEngine`."""
        self.config = config
        self._lora_source = lora_source
        self._kv_tier = kv_tier
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._wake = threading.Event()
        self._stopped = False
        self.draining = False
        self._rebuilding = False
        self.rebuild_error: BaseException | None = None
        self.num_engine_failures = 0
        self._heartbeat = time.monotonic()  # the loop's last sign of life
        self._busy_since_refresh = False  # stepped since the swap objects were counted
        self.dead_error: BaseException | None = None
        # The engine is built on the thread that steps it: with a second OpenMP team alive
        # (the builder thread's), GNU OpenMP's threads sleep between parallel regions and
        # CPU decode steps get markedly slower (docs/design.md has the measurements).
        built = threading.Event()
        failure: list[BaseException] = []
        self._thread = threading.Thread(target=self._main, args=(built, failure),
                                        name="kvray-engine", daemon=True)
        self._thread.start()
        built.wait()
        if failure:
            raise failure[0]
        self.tokenizer = self.engine.tokenizer

    # ---- the engine thread --------------------------------------------------------------
    def _main(self, built: threading.Event, failure: list[BaseException]) -> None:
        try:
            self.engine = LLMEngine(self.config, self._lora_source, self._kv_tier)
            self.built_on = threading.get_ident()
        except BaseException as err:  # the constructor's caller raises it
            failure.append(err)
            return
        finally:
            built.set()
        self._run()

    def _run(self) -> None:
        try:
            while not self._stopped:
                self._heartbeat = time.monotonic()
                self._drain_commands()
                if self._rebuilding or not self.engine.has_unfinished_requests():
                    if not self._rebuilding and self._busy_since_refresh:
                        self._busy_since_refresh = False
                        try:  # once per idle period: what the workers still hold
                            self.engine.refresh_swap_objects()
                            self.engine.refresh_expert_tokens()
                        except Exception as err:  # a dead worker shows at the next step
                            logger.warning("reading the workers' counters failed: %s", err)
                    self._wake.wait(timeout=_IDLE_WAIT_S)
                    self._wake.clear()
                    continue
                try:
                    outputs = self.engine.step()
                except Exception as err:  # a dead or silent worker: fail what is in flight
                    logger.error("engine step failed: %s", err)
                    self.num_engine_failures += 1
                    self._fail_streams(err)
                    self._start_rebuild()
                    continue
                self._busy_since_refresh = True
                for out in outputs:
                    self._deliver(out.request_id, out)
                for request_id, message in self.engine.pop_failed_requests():
                    self._deliver(request_id, KVRayError(message))
        except BaseException as err:  # never die silently: callers must see it
            logger.exception("engine loop died")
            self.dead_error = err
            self._fail_streams(err)

    def _start_rebuild(self) -> None:
        """Rebuild the executor on its own thread, so that the engine thread keeps
        answering aborts and health checks meanwhile; admission is closed until done."""
        if self._rebuilding or self._stopped:
            return
        self._rebuilding = True

        def rebuild() -> None:
            try:
                self.engine.rebuild_executor()
                self.rebuild_error = None
                logger.info("engine executor rebuilt")
            except BaseException as err:
                logger.error("rebuilding the engine executor failed: %s", err)
                self.rebuild_error = err
            finally:
                self._rebuilding = False
                self._wake.set()

        threading.Thread(target=rebuild, name="kvray-engine-rebuild", daemon=True).start()

    def _drain_commands(self) -> None:
        while True:
            try:
                fn, fut = self._commands.get_nowait()
            except queue.Empty:
                return
            if not fut.set_running_or_notify_cancel():
                continue  # the caller was cancelled before we got to it
            try:
                fut.set_result(fn())
            except Exception as err:
                fut.set_exception(err)

    def _deliver(self, request_id: str, item: Any) -> None:
        entry = self._streams.get(request_id)
        if entry is None:
            return
        loop, q = entry
        # Forget a finished stream before its last item can reach the consumer: a client
        # may reuse the id as soon as it has that item.
        if isinstance(item, BaseException) or getattr(item, "finished", False):
            self._streams.pop(request_id, None)
        loop.call_soon_threadsafe(q.put_nowait, item)

    def _fail_streams(self, err: BaseException) -> None:
        logger.debug("failing all streams: %r", err)
        for request_id in list(self._streams):
            self._deliver(request_id, EngineLoopDead(
                "the engine failed while running this request (a worker died or stopped "
                "answering); it was aborted, retry it"))

    def _call(self, fn) -> Future:
        if self.dead_error is not None:
            raise EngineLoopDead("the engine loop stopped; this replica must be restarted")
        fut: Future = Future()
        self._commands.put((fn, fut))
        self._wake.set()
        return fut

    def _admit_and_add(self, request_id: str, prompt: PromptType, params: SamplingParams,
                       priority: int) -> None:
        """On the engine thread, where the queue length is exact: refuse while draining,
        rebuilding or with ``max_waiting`` sequences already waiting; else queue."""
        if self.draining:
            raise ServerBusyError("the server is shutting down; retry on another replica")
        if self._rebuilding or self.engine.executor is None:
            if not self._rebuilding:
                self._start_rebuild()
            raise ServerBusyError("the engine is restarting after a worker failure; retry "
                                  "shortly")
        sched = self.engine.scheduler
        waiting = len(sched.waiting) + len(sched.swap)
        limit = self.config.server.max_waiting
        if waiting + params.n > limit:
            raise ServerBusyError(f"server overloaded: {waiting} sequences waiting "
                                  f"(max_waiting {limit}); retry shortly")
        self.engine.add_request(request_id, prompt, params, priority=priority)

    # ---- asyncio side -------------------------------------------------------------------
    async def generate(self, request_id: str, prompt: PromptType, params: SamplingParams,
                       priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Yield the request's output each time it changes, in the kind ``params`` asks for
        (cumulative, delta or final only), the last one finished. Raises before yielding
        anything: InvalidRequestError (a ValueError) for an invalid request,
        ServerBusyError when it is not admitted; later, RequestTimeoutError past the
        deadline and EngineUnavailableError when the engine failed under it."""
        stream = await self.open_stream(request_id, prompt, params, priority)
        try:
            async for item in stream:
                yield item
        finally:
            await stream.aclose()

    async def open_stream(self, request_id: str, prompt: PromptType, params: SamplingParams,
                          priority: int = 0) -> AsyncGenerator[RequestOutput, None]:
        """Admit the request (raising what :meth:`generate` raises before its first output)
        and return its output stream, already started: closing it at any point, even
        before the first output, aborts the request unless it finished."""
        stream = self._stream(request_id, prompt, params, priority)
        await stream.__anext__()  # admission; then the stream waits inside its try
        return stream

    async def _stream(self, request_id: str, prompt: PromptType, params: SamplingParams,
                      priority: int) -> AsyncGenerator[Any, None]:
        timeout = self.config.server.request_timeout_s
        deadline = None if timeout is None else time.monotonic() + timeout
        q = await self._admit(request_id, prompt, params, priority)
        delta = params.output_kind is RequestOutputKind.DELTA
        # stream_interval > 1: after the first token, hold deltas until that many tokens
        # (of the longest sequence) gathered, so each hop carries fewer, larger chunks.
        interval = self.config.server.stream_interval if delta else 1
        held: RequestOutput | None = None
        sent_tokens = False
        finished = False
        try:
            yield None  # admitted (open_stream's marker, never an output)
            while not finished:
                item = await self._next_output(q, delta, deadline)
                if isinstance(item, BaseException):
                    finished = True  # the engine has forgotten it already
                    raise item
                if held is not None:
                    held.add(item)
                    item, held = held, None
                finished = item.finished
                if interval > 1 and not finished:
                    longest = max((len(c.token_ids) for c in item.outputs), default=0)
                    if sent_tokens and longest < interval:
                        held = item
                        continue
                    sent_tokens = sent_tokens or longest > 0
                yield item
        finally:
            if not finished:  # cancelled, timed out or the consumer stopped: free the blocks
                self._streams.pop(request_id, None)
                with contextlib.suppress(EngineLoopDead):
                    self._call(lambda: self.engine.abort_request(request_id))

    async def _admit(self, request_id: str, prompt: PromptType, params: SamplingParams,
                     priority: int) -> asyncio.Queue:
        """Register the request's output queue and add it on the engine thread (raising
        what admission raises, the queue then gone); the queue."""
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        q: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), q)
        try:
            await asyncio.wrap_future(self._call(
                lambda: self._admit_and_add(request_id, prompt, params, priority)))
        except BaseException:
            self._streams.pop(request_id, None)
            if not isinstance(self.dead_error, BaseException):  # cancelled mid-add: undo it
                with contextlib.suppress(EngineLoopDead):
                    self._call(lambda: self.engine.abort_request(request_id))
            raise
        return q

    async def _next_output(self, q: asyncio.Queue, delta: bool,
                           deadline: float | None) -> Any:
        """The next output (what queued up behind it folded in: the consumer lags) or the
        error that ended the request; RequestTimeoutError past ``deadline``."""
        if deadline is None:
            item = await q.get()
        else:
            try:
                item = await asyncio.wait_for(q.get(), deadline - time.monotonic())
            except TimeoutError:
                timeout = self.config.server.request_timeout_s
                raise RequestTimeoutError(
                    f"the request ran past its deadline ({timeout:g} s, "
                    "request_timeout_s) and was aborted") from None
        item, error = fold_queued(item, q, delta)
        return item if error is None else error  # an error wins over queued outputs

    async def check_health(self) -> None:
        """Raise EngineUnavailableError unless the engine loop is alive and, when it has
        work, has come round within ``worker_timeout_s`` (every remote wait of a step is
        bounded by it, so a longer silence means the loop is wedged)."""
        if self.dead_error is not None or not self._thread.is_alive():
            raise EngineLoopDead("the engine loop stopped")
        if self._stopped:
            raise EngineUnavailableError("the engine was shut down")
        bound = 2 * self.config.parallel.worker_timeout_s + 10.0
        silent = time.monotonic() - self._heartbeat
        if silent > bound:
            raise EngineUnavailableError(f"the engine loop has not come round for "
                                         f"{silent:.0f} s")
        if self.rebuild_error is not None and self.engine.executor is None \
                and not self._rebuilding:
            raise EngineUnavailableError("the engine's workers could not be rebuilt")

    def begin_drain(self) -> None:
        """Admit nothing more; requests in flight go on."""
        self.draining = True

    def num_in_flight(self) -> int:
        return len(self._streams)

    async def abort_all(self, message: str = "the server shut down before the request "
                        "finished") -> int:
        """End every request in flight with ServerBusyError(``message``); their number."""
        return await asyncio.wrap_future(self._call(
            lambda: self._end(list(self._streams), message)))

    async def abort(self, request_ids: list[str], message: str) -> None:
        """End these requests (those still in flight) with ServerBusyError(``message``)."""
        await asyncio.wrap_future(self._call(lambda: self._end(request_ids, message)))

    def _end(self, request_ids: list[str], message: str) -> int:
        """On the engine thread: abort those of ``request_ids`` still in flight and end
        their streams with ServerBusyError(``message``); their number."""
        ended = [r for r in request_ids if r in self._streams]
        for request_id in ended:
            self.engine.abort_request(request_id)
            self._deliver(request_id, ServerBusyError(message))
        return len(ended)

    def stats(self):
        """The engine counters as of its last update, copied by the engine thread (never
        read while that thread is changing them)."""
        return self.engine.published_stats

    # ---- LoRA adapters (the registry is thread-safe; reading an adapter takes a while) ---
    async def list_loras(self) -> list[str]:
        loras = self.engine.loras
        return [] if loras is None else loras.names()

    async def load_lora(self, name: str, path: str) -> None:
        """Serve the PEFT adapter at ``path`` as ``name`` (LoRAError, a 400, if it cannot
        be served here)."""
        loras = self._loras()
        await asyncio.to_thread(loras.register, name, path)

    async def unload_lora(self, name: str) -> bool:
        return self._loras().unregister(name)

    def _loras(self):
        if self.engine.loras is None:
            raise InvalidRequestError("this server runs no LoRA adapters (start it with "
                                      "enable_lora)", "lora_name")
        return self.engine.loras

    def expert_load(self, timeout_s: float = 60.0) -> dict[int, list[int]]:
        """:meth:`LLMEngine.expert_load`, read on the engine thread (after its current
        step); from any other thread."""
        return self._call(self.engine.expert_load).result(timeout_s)

    def engine_stats(self) -> list[tuple[str, dict]]:
        """(replica, stats) pairs, the shape the HTTP front end reads."""
        return [("0", vars(self.engine.published_stats).copy())]

    def shutdown(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=10)
        self.engine.shutdown()
