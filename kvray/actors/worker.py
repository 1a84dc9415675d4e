"""A worker owns one device: its shard of the model and of the KV cache.

The same class runs in-process (``UniProcExecutor``) and inside a Ray actor
(``RayExecutor``). With more than one rank it first joins a ``torch.distributed`` process
group (NCCL on CUDA, gloo on CPU) and builds its tensor-parallel group; pipeline stages talk
point to point over the global group.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from kvray.actors import kv_sizing
from kvray.actors.model_runner import ModelRunner
from kvray.actors.weights_store import local_model_path
from kvray.config import EngineConfig
from kvray.hardware import available_cores
from kvray.models.spec import ModelSpec
from kvray.parallel import ParallelContext
from kvray.scheduler.output import ModelRunnerOutput, SchedulerOutput

# A collective waiting on a dead peer must fail, not hang for gloo's 30-minute default.
_COLLECTIVE_TIMEOUT = timedelta(seconds=120)


def pick_device() -> torch.device:
    """CUDA when available (this worker's visible GPU), else CPU."""
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def free_port(host: str) -> int:
    """A TCP port free on ``host`` right now (the OS picks it; nothing is hard-coded)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def init_distributed(rank: int, tp_size: int, pp_size: int, init_method: str,
                     device: torch.device) -> ParallelContext:
    """Join the world process group and build the TP groups; rank = pp_rank * tp + tp_rank."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    world = tp_size * pp_size
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                            timeout=_COLLECTIVE_TIMEOUT)
    tp_group = None
    for stage in range(pp_size):  # every rank creates every group, in the same order
        group = dist.new_group(list(range(stage * tp_size, (stage + 1) * tp_size)),
                               timeout=_COLLECTIVE_TIMEOUT)
        if stage == rank // tp_size:
            tp_group = group
    return ParallelContext(tp_rank=rank % tp_size, tp_size=tp_size, pp_rank=rank // tp_size,
                           pp_size=pp_size, tp_group=tp_group if tp_size > 1 else None,
                           world_rank=rank)


def set_cpu_threads(in_actor: bool, world_size: int) -> None:
    """Size torch's thread pool by the cores this process may use. Ray starts actors with
    OMP_NUM_THREADS=1: there the usable cores are shared among the ranks. In-process, torch
    sizes its pool by the host's physical cores, blind to a container's CPU quota: capped to
    it (unless the user set OMP_NUM_THREADS)."""
    cores = available_cores()
    if in_actor:
        torch.set_num_threads(max(1, cores // world_size))
    elif "OMP_NUM_THREADS" not in os.environ and torch.get_num_threads() > cores:
        torch.set_num_threads(cores)


class Worker:
    """One rank of a model replica: its process group, its ModelRunner and KV cache."""

    def __init__(self, config: EngineConfig, model_path: str, rank: int = 0,
                 init_method: str | None = None, device: torch.device | None = None) -> None:
        self.config = config
        self.rank = rank
        self.device = device or pick_device()
        if self.device.type == "cpu":
            set_cpu_threads(in_actor=init_method is not None,
                            world_size=config.parallel.world_size)
        par = config.parallel
        # Only a group this worker joined is its to destroy (an in-process engine may share
        # the process with the user's own torch.distributed group).
        self._owns_process_group = par.world_size > 1
        if par.world_size > 1:
            assert init_method not in (None, "single"), "multi-rank workers need a rendezvous"
            self.ctx = dataclasses.replace(
                init_distributed(rank, par.tensor_parallel_size, par.pipeline_parallel_size,
                                 init_method, self.device),
                expert_parallel=par.enable_expert_parallel)
        else:
            self.ctx = ParallelContext()
        start = time.perf_counter()
        model_path = local_model_path(model_path, config.model.share_weights)
        self.runner = ModelRunner(config, model_path, self.ctx, self.device)
        self.load_s = time.perf_counter() - start

    def startup_report(self) -> dict[str, object]:
        """Seconds this rank spent loading its shard (the kernels' build or fetch
        included), how it got the CPU kernels, the quantized weights its shard holds
        (tensors, bytes, kinds; zeros for a dense model) and, for a MoE model, its expert
        weights' bytes and the expert placement (:func:`~kvray.models.expert_stats.expert_report`;
        None for a dense model)."""
        from kvray.kernels import cpu_ops
        from kvray.models.expert_stats import expert_report

        return {"load_s": round(self.load_s, 3), "kernels": cpu_ops.build_report(),
                "quantized": self.runner.quantized.report(),
                "moe": expert_report(self.runner.model, self.runner.expert_loads)}

    def model_info(self) -> tuple[ModelSpec, int]:
        """(spec, max_model_len) for the engine, which holds no model itself."""
        return self.runner.spec, self.runner.max_model_len

    # KV cache sizing, run on every worker by the executor's collective_rpc (see
    # kvray.actors.executor.initialize_kv_cache).
    def determine_num_blocks(self) -> int:
        """KV blocks this worker can hold within its memory budget."""
        return kv_sizing.determine_num_blocks(self.runner)

    def kv_bytes_per_block(self) -> int:
        """Bytes one KV block takes on this worker's shard."""
        return kv_sizing.bytes_per_block(self.runner)

    def initialize_cache(self, num_blocks: int) -> None:
        """Allocate ``num_blocks`` KV blocks (the minimum over all workers)."""
        self.runner.initialize_cache(num_blocks)

    def execute_model(self, out: SchedulerOutput, prev: ModelRunnerOutput | None = None
                      ) -> ModelRunnerOutput | None:
        """Run one step (``prev``: the previous step's output, for placeholders)."""
        return self.runner.execute_model(out, prev)

    def swap_objects(self) -> int:
        """How many swapped-out requests this worker still holds (for leak checks)."""
        return len(self.runner.swap_pool)

    def take_expert_tokens(self) -> dict[int, list[int]]:
        """Tokens routed to each expert of this rank's MoE layers since the previous call,
        by global layer index (empty on ranks that do not count)."""
        return self.runner.take_expert_tokens()

    def shutdown(self) -> None:
        """Free the model, KV cache and graphs (see :meth:`ModelRunner.release`) and leave
        the process group this worker joined."""
        self.runner.release()
        if self._owns_process_group and dist.is_initialized():
            dist.destroy_process_group()
