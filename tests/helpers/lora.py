"""Random PEFT LoRA adapters for the tiny test models, and PEFT's own greedy tokens (the
reference kvray's adapters are compared against)."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.helpers.tiny_models import load_hf

ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
ALL = ATTN + ["gate_proj", "up_proj", "down_proj"]


def make_lora_adapter(base_dir: str | Path, path: str | Path, rank: int = 8,
                      targets: list[str] | None = None, seed: int = 0, alpha: float = 16.0,
                      rslora: bool = False, scale: float = 0.15) -> Path:
    """Save a PEFT adapter of ``base_dir``'s model with random A and B (PEFT starts B at
    zero, which would change nothing) to ``path``; return the path."""
    from peft import LoraConfig, get_peft_model

    model = load_hf(base_dir)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets or ALL,
                        use_rslora=rslora, lora_dropout=0.0, init_lora_weights=False)
    peft_model = get_peft_model(model, config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=g) * scale)
    path = Path(path)
    peft_model.save_pretrained(str(path))
    return path


def peft_greedy(base_dir: str | Path, adapter_dir: str | Path | None,
                prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy tokens of transformers with the adapter applied by PEFT (fp32, EOS ignored);
    ``adapter_dir`` None: the base model."""
    model = load_hf(base_dir)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter_dir)).eval()
    with torch.inference_mode():
        return [model.generate(input_ids=torch.tensor([p]), max_new_tokens=max_tokens,
                               do_sample=False, eos_token_id=None, pad_token_id=0
                               )[0, len(p):].tolist() for p in prompts]
