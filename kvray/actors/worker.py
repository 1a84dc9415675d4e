"""A worker owns one device: its shard of the model and of the KV cache.

The same class runs in-process (``UniProcExecutor``) and inside a Ray actor.
"""

from __future__ import annotations

import torch

from kvray.actors.model_runner import ModelRunner
from kvray.config import EngineConfig
from kvray.parallel import ParallelContext
from kvray.scheduler.output import ModelRunnerOutput, SchedulerOutput


def pick_device() -> torch.device:
    """CUDA when available (this worker's visible GPU), else CPU."""
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


class Worker:
    def __init__(self, config: EngineConfig, model_path: str,
                 ctx: ParallelContext | None = None, device: torch.device | None = None) -> None:
        self.config = config
        self.ctx = ctx or ParallelContext()
        self.device = device or pick_device()
        self.runner = ModelRunner(config, model_path, self.ctx, self.device)

    @property
    def max_model_len(self) -> int:
        return self.runner.max_model_len

    def determine_num_blocks(self) -> int:
        return self.runner.determine_num_blocks()

    def initialize_cache(self, num_blocks: int) -> None:
        self.runner.initialize_cache(num_blocks)

    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput | None:
        return self.runner.execute_model(out)
