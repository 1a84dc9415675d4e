"""GGUF loading: a tiny model written as GGUF (llama.cpp layout) loads into kvray with the
same logits as the original, and transformers' own GGUF reader agrees on the file."""

from __future__ import annotations

import pytest
import torch
import transformers

from kvray.engine.reference import generate_by_recompute
from kvray.kernels.attention import AttentionMetadata
from kvray.models.loader import load_model
from kvray.tokenizer import load_tokenizer
from tests.helpers.tiny_gguf import write_gguf
from tests.helpers.tiny_models import VOCAB_SIZE, load_hf

pytestmark = pytest.mark.parity


@pytest.mark.parametrize("arch", ["llama_gqa", "qwen2_bias", "qwen3_qknorm_headdim"])
@torch.inference_mode()
def test_gguf_logits_and_greedy_tokens_match_the_hf_original(arch, tiny_model_dir, tmp_path):
    src = tiny_model_dir(arch)
    gguf_path = write_gguf(src, tmp_path / f"{arch}.gguf")
    hf = load_hf(src)
    model, _ = load_model(gguf_path, "float32")
    lengths = [9, 30, 1]
    seqs = [torch.randint(3, VOCAB_SIZE, (n,)) for n in lengths]
    ours = model.compute_logits(model(torch.cat(seqs), AttentionMetadata.for_full_sequences(
        lengths)))
    ref = torch.cat([hf(s[None]).logits[0] for s in seqs])
    assert (ours - ref).abs().max().item() <= 1e-4
    prompt = seqs[1]
    expected = hf.generate(prompt[None], max_new_tokens=8, do_sample=False, eos_token_id=None,
                           pad_token_id=0)[0, len(prompt):].tolist()
    assert generate_by_recompute(model, prompt.tolist(), 8) == expected


def test_quantization_gguf_names_a_gguf_file_and_other_format_names_are_errors(
        tiny_model_dir, tmp_path):
    """vLLM's ``--quantization gguf`` loads the file as stored; a format it is not in is an
    error naming both."""
    gguf_path = write_gguf(tiny_model_dir("llama_gqa"), tmp_path / "m.gguf")
    model, _ = load_model(gguf_path, "float32", quantization="gguf")
    assert model.spec.num_layers == 3
    with pytest.raises(ValueError, match="quantization = 'gptq'.*is gguf"):
        load_model(gguf_path, "float32", quantization="gptq")


@pytest.mark.parametrize("arch", ["llama_gqa", "qwen2_bias"])
@torch.inference_mode()
def test_transformers_reads_our_test_gguf_identically(arch, tiny_model_dir, tmp_path):
    """Independent check that the test writer follows llama.cpp's layout (Q/K permutation)."""
    pytest.importorskip("accelerate")
    src = tiny_model_dir(arch)
    write_gguf(src, tmp_path / "m.gguf")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file="m.gguf", dtype=torch.float32)
    ids = torch.randint(3, VOCAB_SIZE, (1, 12))
    assert torch.allclose(theirs(ids).logits, load_hf(src)(ids).logits, atol=1e-5)


def test_gguf_tokenizer_matches_the_original(tiny_model_dir, tmp_path):
    src = tiny_model_dir("llama_gqa")
    gguf_path = write_gguf(src, tmp_path / "m.gguf")
    text = "Hello world! The capital of France"
    assert load_tokenizer(gguf_path)(text)["input_ids"] == load_tokenizer(src)(text)["input_ids"]


@pytest.mark.parametrize("drop,value,message", [
    ("llama.block_count", None, "'llama.block_count' is missing"),
    ("llama.attention.head_count", [4, 4], "expected one int"),
])
def test_gguf_with_missing_or_per_layer_metadata_names_the_key(tmp_path, drop, value,
                                                               message):
    """Regression: a GGUF lacking a required key (or holding a per-layer array) failed with
    a bare TypeError; it is an UnsupportedModelError naming the key."""
    import gguf
    import numpy as np

    from kvray.models.gguf_loader import GGUFCheckpoint
    from kvray.models.spec import UnsupportedModelError

    path = tmp_path / "bad.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    keys = {"llama.block_count": 2, "llama.embedding_length": 32,
            "llama.feed_forward_length": 64, "llama.attention.head_count": 4}
    for key, v in keys.items():
        if key != drop:
            w.add_uint32(key, v)
        elif value is not None:
            w.add_array(key, value)
    w.add_tensor("token_embd.weight", np.zeros((16, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedModelError, match=message):
        GGUFCheckpoint(path)
