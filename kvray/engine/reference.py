"""Generation by recomputation: the whole sequence goes through the model at every step.

Slow and obviously correct; the ground truth the paged engine is tested against.
"""

from __future__ import annotations

import torch

from kvray.kernels.attention import AttentionMetadata
from kvray.models.llama import LlamaForCausalLM


@torch.inference_mode()
def generate_by_recompute(model: LlamaForCausalLM, prompt_ids: list[int], max_tokens: int,
                          temperature: float = 0.0, stop_ids: tuple[int, ...] = (),
                          seed: int = 0) -> list[int]:
    """Return up to ``max_tokens`` new token ids, stopping after one in ``stop_ids``."""
    gen = torch.Generator().manual_seed(seed)
    ids = list(prompt_ids)
    out: list[int] = []
    for _ in range(max_tokens):
        hidden = model(torch.tensor(ids), AttentionMetadata.for_full_sequences([len(ids)]))
        logits = model.compute_logits(hidden[-1:]).float()[0]
        if temperature == 0.0:
            token = int(logits.argmax())
        else:
            probs = torch.softmax(logits / temperature, dim=-1)
            token = int(torch.multinomial(probs, 1, generator=gen))
        ids.append(token)
        out.append(token)
        if token in stop_ids:
            break
    return out
