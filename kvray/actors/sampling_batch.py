"""A step's :class:`~kvray.kernels.sampling.SamplingBatch` from its requests'
:class:`~kvray.sampling_params.SamplingParams` (the kernels take plain columns, not params)."""

from __future__ import annotations

import torch

from kvray.kernels.sampling import SamplingBatch
from kvray.sampling_params import SamplingParams


def sampling_batch(params: list[SamplingParams], generators: list[torch.Generator | None],
                   prompt_token_ids: list[list[int]], output_token_ids: list[list[int]],
                   device: torch.device | str = "cpu",
                   token_bitmask: torch.Tensor | None = None) -> SamplingBatch:
    """The batch for rows ``params[i]`` (greedy rows get temperature 0.0). A
    :attr:`~SamplingBatch.plain_greedy` batch keeps its columns on the host, where they were
    built: nothing reads them, and on a GPU their seven copies were a fair part of a small
    model's decode step."""
    assert len(params) == len(generators) == len(prompt_token_ids) == len(output_token_ids)

    def column(values: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype)

    batch = SamplingBatch(
        temperature=column([0.0 if p.is_greedy else p.temperature for p in params],
                           torch.float32),
        top_p=column([p.top_p for p in params], torch.float32),
        top_k=column([p.top_k for p in params], torch.int64),
        min_p=column([p.min_p for p in params], torch.float32),
        repetition_penalty=column([p.repetition_penalty for p in params], torch.float32),
        presence_penalty=column([p.presence_penalty for p in params], torch.float32),
        frequency_penalty=column([p.frequency_penalty for p in params], torch.float32),
        generators=list(generators),
        prompt_token_ids=prompt_token_ids,
        output_token_ids=output_token_ids,
        logit_bias=[p.logit_bias or None for p in params],
        banned_token_ids=[p.banned_after(out)
                          for p, out in zip(params, output_token_ids, strict=True)],
        allowed_token_ids=[p.allowed_token_ids for p in params],
        num_logprobs=max((p.logprobs or 0 for p in params), default=0),
        need_logprobs=any(p.logprobs is not None for p in params),
        token_bitmask=token_bitmask,
        eos_token_ids=[p.eos_token_ids for p in params] if token_bitmask is not None else [],
    )
    return batch if batch.plain_greedy else batch.to(device)
