"""Random MoE routing for the expert tests: top-k among the allowed experts."""

from __future__ import annotations

import torch


def random_routing(tokens: int, num_experts: int, top_k: int, allowed: list[int], seed: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, expert ids) [tokens, top_k]: each token's top_k of ``allowed`` by random
    scores, the weights their softmax (experts outside ``allowed`` get no token)."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(tokens, num_experts, generator=g)
    mask = torch.full((num_experts,), float("-inf"))
    mask[allowed] = 0
    weights, choice = (scores + mask).topk(top_k, dim=-1)
    return torch.softmax(weights, dim=-1), choice
