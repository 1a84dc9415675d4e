"""What a model's MoE layers did and hold: the tokens routed to each expert of each layer,
counted on the device during the steps (:class:`ExpertTokenCounts`: the load that expert
placement balances and the metrics show), and each rank's experts for the start-up report
(:func:`expert_report`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from kvray.models.expert_placement import contiguous_experts, rank_imbalance
from kvray.models.moe import MoEExperts


class ExpertTokenCounts:
    """Tokens routed to each expert, one int64 row per MoE layer of a model, added to on the
    model's device (no host sync) and read with :meth:`take`.

    Counts only inside :meth:`counting`, and only that forward's first ``num_rows`` token
    rows: the runner opens it around each step's forward with the step's real tokens, so a
    CUDA-graph batch's pad rows, the KV-sizing profile run and graph captures count
    nothing."""

    def __init__(self, layers: Sequence[int], num_experts: int,
                 device: torch.device | str) -> None:
        self.layers = list(layers)  # global layer index of each row
        self.row = {layer: i for i, layer in enumerate(self.layers)}
        self.counts = torch.zeros(len(self.layers), num_experts, dtype=torch.int64,
                                  device=device)
        self.num_rows = 0  # token rows of the forward in progress to count; 0: none

    @contextlib.contextmanager
    def counting(self, num_rows: int) -> Iterator[None]:
        """Count the routing of the first ``num_rows`` token rows of the forwards inside."""
        self.num_rows = num_rows
        try:
            yield
        finally:
            self.num_rows = 0

    def add(self, layer: int, experts: torch.Tensor, counts: torch.Tensor) -> None:
        """Layer ``layer``'s routing: ``experts`` [tokens, k] and its ``bincount``."""
        if not self.num_rows:
            return
        if experts.shape[0] > self.num_rows:  # rows past the real ones: padding
            counts = torch.bincount(experts[:self.num_rows].reshape(-1),
                                    minlength=self.counts.shape[1])
        self.counts[self.row[layer]] += counts

    def take(self) -> dict[int, list[int]]:
        """Tokens per expert since the previous take, by global layer index; restarts the
        counts at zero."""
        counts = self.counts.tolist()
        self.counts.zero_()
        return dict(zip(self.layers, counts, strict=True))


def count_expert_tokens(model: nn.Module, device: torch.device | str
                        ) -> ExpertTokenCounts | None:
    """One :class:`ExpertTokenCounts` for every MoE layer of ``model`` (None: no MoE layer
    here), attached to those layers."""
    layers = [m for m in model.modules() if isinstance(m, MoEExperts)]
    if not layers:
        return None
    counter = ExpertTokenCounts([m.layer_idx for m in layers], layers[0].num_experts, device)
    for m in layers:
        m.token_counts = counter
    return counter


def expert_report(model: nn.Module, loads: Mapping[int, Sequence[int]] | None
                  ) -> dict[str, Any] | None:
    """This rank's MoE layers for the start-up report (None for a dense model): the bytes
    of its expert weights and, under expert parallelism, every rank's experts per layer;
    with measured ``loads`` (``expert_placement``) also each layer's predicted rank
    imbalance (busiest rank's tokens over the mean rank's) under this placement and under
    the contiguous one."""
    layers = [m for m in model.modules() if isinstance(m, MoEExperts)]
    if not layers:
        return None
    report: dict[str, Any] = {
        "expert_parallel": layers[0].placement is not None,
        "expert_bytes": sum(m.held_bytes() for m in layers),
        "placement": {m.layer_idx: [list(r) for r in m.placement] for m in layers
                      if m.placement is not None}}
    if loads and report["expert_parallel"]:
        report["predicted_imbalance"] = {
            m.layer_idx: round(rank_imbalance(loads[m.layer_idx], m.placement), 4)
            for m in layers}
        report["contiguous_imbalance"] = {
            m.layer_idx: round(rank_imbalance(loads[m.layer_idx], contiguous_experts(
                m.num_experts, len(m.placement))), 4) for m in layers}
    return report
