"""Where this process sits in a model replica's TP x PP grid, and its collectives.

Passed explicitly to every parallel layer (no module-level state). With
``tp_size == 1`` the collectives are no-ops, so the single-process path pays nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ParallelContext:
    """This worker's coordinates and process groups.

    Attributes:
        tp_rank / tp_size: position in the tensor-parallel group.
        pp_rank / pp_size: pipeline stage index and count.
        tp_group: torch.distributed group of this stage's TP ranks (None when tp_size == 1).
        expert_parallel: MoE layers shard whole experts over the TP ranks instead of
            slicing every expert (``enable_expert_parallel``).
        expert_placement: under expert parallelism, per MoE layer (global index) the
            experts each TP rank holds; None = contiguous ranges
            (:mod:`kvray.models.expert_placement`).
    """

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    tp_group: Any = None
    world_rank: int = 0  # rank in the replica's world group (pp_rank * tp_size + tp_rank)
    expert_parallel: bool = False
    expert_placement: Mapping[int, tuple[tuple[int, ...], ...]] | None = field(
        default=None, hash=False)

    def __post_init__(self) -> None:
        assert 0 <= self.tp_rank < self.tp_size, (self.tp_rank, self.tp_size)
        assert 0 <= self.pp_rank < self.pp_size, (self.pp_rank, self.pp_size)

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def is_output_rank(self) -> bool:
        """The rank that samples and returns tokens: last stage, TP rank 0."""
        return self.is_last_stage and self.tp_rank == 0

    def send_to_next_stage(self, tensors: list[torch.Tensor]) -> None:
        """Send activations to the same TP rank of the next pipeline stage."""
        for t in tensors:
            dist.send(t.contiguous(), dst=self.world_rank + self.tp_size)

    def recv_from_prev_stage(self, shapes: list[tuple[int, ...]], dtype: torch.dtype,
                             device: torch.device) -> list[torch.Tensor]:
        out = []
        for shape in shapes:
            t = torch.empty(shape, dtype=dtype, device=device)
            dist.recv(t, src=self.world_rank - self.tp_size)
            out.append(t)
        return out

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the TP group (in place when distributed)."""
        if self.tp_size > 1:
            dist.all_reduce(x, group=self.tp_group)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate each TP rank's ``x`` along the last dimension, in rank order."""
        if self.tp_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.tp_size)]
        dist.all_gather(parts, x.contiguous(), group=self.tp_group)
        return torch.cat(parts, dim=-1)


def pp_layer_range(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """Contiguous [start, end) layers of stage ``pp_rank``; earlier stages take the remainder."""
    if num_layers < pp_size:
        raise ValueError(
            f"pipeline_parallel_size ({pp_size}) exceeds the model's {num_layers} layers"
        )
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return start, start + base + (1 if pp_rank < extra else 0)
