"""Executors hand each SchedulerOutput to the worker(s) and return the sampled tokens.

``UniProcExecutor``: one in-process worker (tests, TP = PP = 1, no Ray start-up cost).
``RayExecutor`` (kvray.actors.ray_executor): TP x PP worker actors in a placement group.
"""

from __future__ import annotations

from kvray.actors.worker import Worker
from kvray.config import EngineConfig
from kvray.scheduler.output import ModelRunnerOutput, SchedulerOutput


class UniProcExecutor:
    def __init__(self, config: EngineConfig, model_path: str) -> None:
        self.worker = Worker(config, model_path)
        self.spec, self.max_model_len = self.worker.model_info()
        self.broadcast_s = 0.0

    def determine_num_blocks(self) -> int:
        return self.worker.determine_num_blocks()

    def kv_bytes_per_block(self) -> int:
        return self.worker.kv_bytes_per_block()

    def initialize_cache(self, num_blocks: int) -> None:
        self.worker.initialize_cache(num_blocks)

    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(out)

    def swap_objects(self) -> list[int]:
        return [self.worker.swap_objects()]

    def shutdown(self) -> None:
        self.worker = None


def executor_backend(config: EngineConfig) -> str:
    """``uni`` or ``ray``: as configured, else ``ray`` exactly when TP x PP > 1."""
    par = config.parallel
    backend = par.distributed_executor_backend or ("ray" if par.world_size > 1 else "uni")
    if backend == "uni" and par.world_size > 1:
        raise ValueError(
            f"distributed_executor_backend='uni' runs one worker, but tensor_parallel_size x "
            f"pipeline_parallel_size = {par.world_size}; use 'ray' or leave it unset")
    return backend


def make_executor(config: EngineConfig, model_path: str):
    if executor_backend(config) == "ray":
        from kvray.actors.ray_executor import RayExecutor

        return RayExecutor(config, model_path)
    return UniProcExecutor(config, model_path)
