"""The executor interface: how the engine core drives its worker(s).

An executor owns one model replica's workers and hands each step's ``SchedulerOutput`` to
all of them, returning the sampled tokens. Two implementations share this interface:
``UniProcExecutor`` (one in-process worker: tests, TP = PP = 1, no Ray start-up cost) and
``RayExecutor`` (TP x PP worker actors in a placement group). The engine sees only
:class:`Executor`; this module imports neither torch nor Ray.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from kvray.config import EngineConfig
from kvray.scheduler.output import ModelRunnerOutput, SchedulerOutput

if TYPE_CHECKING:
    from kvray.models.spec import ModelSpec


class Executor(Protocol):
    """What the engine core calls on its workers: the KV cache set-up
    (:func:`initialize_kv_cache`, through :meth:`collective_rpc`), then steps."""

    spec: ModelSpec  # the model's architecture facts (read by the workers)
    max_model_len: int  # resolved context length
    broadcast_s: float  # seconds spent shipping SchedulerOutputs to workers so far

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        """Call the :class:`~kvray.actors.worker.Worker` method ``method`` with ``args`` on
        every worker; their results in rank order. For start-up work (bounded by the
        start-up timeout, not a step's), never for steps."""
        ...

    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step on all workers; the sampling worker's result."""
        ...

    def submit_step(self, out: SchedulerOutput) -> Any:
        """Start one step and return a handle at once, so that the next step can be
        submitted while this one is in the pipeline; workers run steps in submission
        order."""
        ...

    def collect_step(self, handle: Any) -> ModelRunnerOutput:
        """Wait for a step started by :meth:`submit_step`; the sampling worker's result."""
        ...

    def swap_objects(self) -> list[int]:
        """Per worker, how many swapped-out requests it still holds (leak checks)."""
        ...

    def take_expert_tokens(self) -> list[dict[int, list[int]]]:
        """Per pipeline stage, the tokens routed to each expert of its MoE layers since the
        previous call ({global layer: count per expert}; empty for a dense model). A round
        trip to the workers, queued behind the steps in flight: not for every step."""
        ...

    def shutdown(self) -> None:
        """Release the workers (and any Ray actors / placement group); idempotent."""
        ...


@dataclass(frozen=True)
class KVCacheSize:
    """The KV cache every worker of a replica holds, as :func:`initialize_kv_cache` sized it."""

    num_blocks: int  # blocks on each worker: the smallest count any worker can hold
    bytes_per_block: int  # on the largest worker shard (what a swapped block costs)


def initialize_kv_cache(executor: Executor) -> KVCacheSize:
    """Size the KV cache and allocate it on every worker: each worker finds how many blocks
    fit its memory budget (a profile run on CUDA); all allocate the smallest count, so that
    one block id means the same slot on every shard."""
    num_blocks = min(executor.collective_rpc("determine_num_blocks"))
    executor.collective_rpc("initialize_cache", num_blocks)
    return KVCacheSize(num_blocks, max(executor.collective_rpc("kv_bytes_per_block")))


def executor_backend(config: EngineConfig) -> str:
    """``uni`` or ``ray``: as configured, else ``ray`` exactly when TP x PP > 1 or the
    workers are pinned to nodes."""
    par = config.parallel
    wants_ray = par.world_size > 1 or par.pipeline_stage_nodes is not None
    backend = par.distributed_executor_backend or ("ray" if wants_ray else "uni")
    if backend == "uni" and par.pipeline_stage_nodes is not None:
        raise ValueError(
            "pipeline_stage_nodes pins workers to Ray nodes, but distributed_executor_backend"
            "='uni' runs the model in this process; use 'ray' or leave it unset")
    if backend == "uni" and par.world_size > 1:
        raise ValueError(
            f"distributed_executor_backend='uni' runs one worker, but tensor_parallel_size x "
            f"pipeline_parallel_size = {par.world_size}; use 'ray' or leave it unset")
    return backend


def make_executor(config: EngineConfig, model_path: str) -> Executor:
    """Build the executor the config asks for (imports torch / Ray only then)."""
    cls: Any
    if executor_backend(config) == "ray":
        from kvray.actors.ray_executor import RayExecutor as cls
    else:
        from kvray.actors.uniproc_executor import UniProcExecutor as cls
    return cls(config, model_path)
