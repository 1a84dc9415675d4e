"""AsyncLLM: the engine core's step loop on a background thread, fed by asyncio callers.

The server's request handlers run on an event loop; the engine steps for ~100 ms at a time.
One thread owns the ``LLMEngine`` and runs ``step()`` while there is work; handlers talk to
it through a command queue and receive per-request output streams. A handler that is
cancelled (client disconnected) aborts its request, freeing its blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections.abc import AsyncIterator
from concurrent.futures import Future
from typing import Any

from kvray.config import EngineConfig
from kvray.engine.llm_engine import LLMEngine, PromptType
from kvray.outputs import RequestOutput
from kvray.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)


class EngineLoopDead(RuntimeError):
    """The engine loop stopped; the message says why."""


class AsyncLLM:
    def __init__(self, config: EngineConfig) -> None:
        self.engine = LLMEngine(config)
        self.tokenizer = self.engine.tokenizer
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._wake = threading.Event()
        self._stopped = False
        self.dead_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kvray-engine", daemon=True)
        self._thread.start()

    # ---- the engine thread --------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stopped:
                self._drain_commands()
                if not self.engine.has_unfinished_requests():
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
                    continue
                try:
                    outputs = self.engine.step()
                except Exception as err:  # a dead worker: fail what is in flight, go on
                    logger.error("engine step failed: %s", err)
                    self._fail_streams(err)
                    continue
                for out in outputs:
                    self._deliver(out.request_id, out)
        except BaseException as err:  # never die silently: callers must see it
            logger.exception("engine loop died")
            self.dead_error = err
            self._fail_streams(err)

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
        loop.call_soon_threadsafe(q.put_nowait, item)
        if isinstance(item, BaseException) or getattr(item, "finished", False):
            self._streams.pop(request_id, None)

    def _fail_streams(self, err: BaseException) -> None:
        for request_id in list(self._streams):
            self._deliver(request_id, EngineLoopDead(f"request failed: {err}"))

    def _call(self, fn) -> Future:
        if self.dead_error is not None:
            raise EngineLoopDead(f"the engine loop stopped: {self.dead_error}")
        fut: Future = Future()
        self._commands.put((fn, fut))
        self._wake.set()
        return fut

    # ---- asyncio side -------------------------------------------------------------------
    async def generate(self, request_id: str, prompt: PromptType, params: SamplingParams,
                       priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Yield the request's output each time it changes, in the kind ``params`` asks for
        (cumulative, delta or final only), the last one finished. Raises ValueError for an
        invalid request before yielding anything."""
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        q: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), q)
        try:
            await asyncio.wrap_future(self._call(
                lambda: self.engine.add_request(request_id, prompt, params, priority=priority)))
        except BaseException:
            self._streams.pop(request_id, None)
            if not isinstance(self.dead_error, BaseException):  # cancelled mid-add: undo it
                with contextlib.suppress(EngineLoopDead):
                    self._call(lambda: self.engine.abort_request(request_id))
            raise
        delta = params.output_kind is RequestOutputKind.DELTA
        finished = False
        try:
            while not finished:
                item = await q.get()
                # When the consumer lags, fold what queued up into one output, so a busy
                # server sends fewer, larger chunks instead of falling further behind.
                while not q.empty() and not isinstance(item, BaseException):
                    later = q.get_nowait()
                    if delta and not isinstance(later, BaseException):
                        item.add(later)
                    else:  # a cumulative output supersedes the previous; an error wins
                        item = later
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:  # cancelled or the consumer stopped early: free the blocks
                self._streams.pop(request_id, None)
                with contextlib.suppress(EngineLoopDead):
                    self._call(lambda: self.engine.abort_request(request_id))

    def stats(self):
        """The engine counters as of its last update, copied by the engine thread (never
        read while that thread is changing them)."""
        return self.engine.published_stats

    def engine_stats(self) -> list[tuple[str, dict]]:
        """(replica, stats) pairs, the shape the HTTP front end reads."""
        return [("0", vars(self.engine.published_stats).copy())]

    def shutdown(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=10)
        self.engine.shutdown()

