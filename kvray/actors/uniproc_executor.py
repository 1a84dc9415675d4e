"""UniProcExecutor: one worker in this process (TP = PP = 1, no Ray start-up cost)."""

from __future__ import annotations

from typing import Any

from kvray.actors.worker import Worker
from kvray.config import EngineConfig
from kvray.scheduler.output import ModelRunnerOutput, SchedulerOutput


class UniProcExecutor:
    """The :class:`~kvray.actors.executor.Executor` over one in-process :class:`Worker`."""

    def __init__(self, config: EngineConfig, model_path: str) -> None:
        self.worker: Worker | None = Worker(config, model_path)
        self.spec, self.max_model_len = self.worker.model_info()
        self.broadcast_s = 0.0  # nothing crosses a process boundary

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        return [getattr(self.worker, method)(*args)]

    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(out)

    def submit_step(self, out: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(out)  # one worker, one stage: nothing to overlap

    def collect_step(self, handle: ModelRunnerOutput) -> ModelRunnerOutput:
        return handle

    def swap_objects(self) -> list[int]:
        return [self.worker.swap_objects()]

    def take_expert_tokens(self) -> list[dict[int, list[int]]]:
        return [self.worker.take_expert_tokens()]

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()  # its device memory goes back now, not at collection
        self.worker = None
