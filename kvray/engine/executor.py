"""Executors hand each SchedulerOutput to the worker(s) and return the sampled tokens.

``UniProcExecutor``: one in-process worker (tests, TP = PP = 1, no Ray start-up cost).
"""

from __future__ import annotations

from kvray.actors.worker import Worker
from kvray.config import EngineConfig
from kvray.scheduler.output import ModelRunnerOutput, SchedulerOutput


class UniProcExecutor:
    def __init__(self, config: EngineConfig, model_path: str) -> None:
        self.worker = Worker(config, model_path)

    @property
    def spec(self):
        return self.worker.runner.spec

    @property
    def max_model_len(self) -> int:
        return self.worker.max_model_len

    def determine_num_blocks(self) -> int:
        return self.worker.determine_num_blocks()

    def initialize_cache(self, num_blocks: int) -> None:
        self.worker.initialize_cache(num_blocks)

    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(out)

    def shutdown(self) -> None:
        self.worker = None
