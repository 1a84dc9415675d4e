"""UniProcExecutor: one worker in this process (TP = PP = 1, no Ray start-up cost).

Without async scheduling a step runs inside :meth:`UniProcExecutor.submit_step`. With it,
the worker lives on a thread of its own (``kvray-step``) and every call to it, steps and
the rest alike, goes there in order: a submitted step runs while the engine's thread
schedules the next one and turns the previous one's tokens into outputs, as a step on an
accelerator runs while the host works.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from kvray.actors.worker import Worker
from kvray.config import EngineConfig
from kvray.scheduler.output import ModelRunnerOutput, SchedulerOutput


class UniProcExecutor:
    """The :class:`~kvray.actors.executor.Executor` over one in-process :class:`Worker`."""

    def __init__(self, config: EngineConfig, model_path: str) -> None:
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="kvray-step") \
            if config.scheduler.async_scheduling else None
        try:
            self.worker: Worker | None = self._call(Worker, config, model_path)
        except BaseException:
            if self._thread is not None:
                self._thread.shutdown(wait=False)
            raise
        self.spec, self.max_model_len = self._call(self.worker.model_info)
        self.broadcast_s = 0.0  # nothing crosses a process boundary
        self._last_result: ModelRunnerOutput | None = None  # read on the step thread only

    def _call(self, fn: Any, *args: Any) -> Any:
        """``fn(*args)`` where the worker lives, after every step submitted before."""
        return fn(*args) if self._thread is None else self._thread.submit(fn, *args).result()

    def _step(self, out: SchedulerOutput) -> ModelRunnerOutput:
        prev = self._last_result if out.placeholder_req_ids else None
        self._last_result = self.worker.execute_model(out, prev)
        return self._last_result

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        return [self._call(getattr(self.worker, method), *args)]

    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        return self._call(self._step, out)

    def submit_step(self, out: SchedulerOutput) -> ModelRunnerOutput | Future:
        if self._thread is None:
            return self._step(out)  # one worker, one stage: it runs now
        return self._thread.submit(self._step, out)

    def collect_step(self, handle: ModelRunnerOutput | Future) -> ModelRunnerOutput:
        return handle.result() if isinstance(handle, Future) else handle

    def swap_objects(self) -> list[int]:
        return [self._call(self.worker.swap_objects)]

    def take_expert_tokens(self) -> list[dict[int, list[int]]]:
        return [self._call(self.worker.take_expert_tokens)]

    def shutdown(self) -> None:
        if self.worker is not None:
            worker, self.worker = self.worker, None
            # its device memory goes back now, not at collection (after any step in flight);
            # at interpreter exit the step thread may be gone already: then here
            try:
                self._call(worker.shutdown)
            except RuntimeError:
                worker.shutdown()
        if self._thread is not None:
            self._thread.shutdown(wait=True)
