"""GGUF loading: a tiny model written as GGUF (llama.cpp layout) loads into kvray with the
same logits as the original, and transformers' own GGUF reader agrees on the file."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

from kvray.engine.reference import generate_by_recompute
from kvray.kernels.attention import AttentionMetadata
from kvray.models.loader import load_model
from kvray.tokenizer import load_tokenizer
from tests.helpers.tiny_gguf import bare_llama_gguf, write_gguf
from tests.helpers.tiny_models import VOCAB_SIZE, load_hf, make_tiny_model

pytestmark = pytest.mark.parity


# Tiny models of each GGUF architecture and rope rule, shaped as the real ones the files
# hold: Gemma 2's converter drops the LM head (tied), and the Gemmas' files hold no query
# scale (head_dim) or layer pattern (every 2nd / 6th layer global).
GGUF_VARIANTS = {
    "llama_gqa": ("llama_gqa", {}),
    "qwen2_bias": ("qwen2_bias", {}),
    "qwen3_qknorm_headdim": ("qwen3_qknorm_headdim", {}),
    "gemma2": ("gemma2_softcap", dict(query_pre_attn_scalar=16, tie_word_embeddings=True,
                                      num_hidden_layers=4)),
    "gemma3": ("gemma3_text", dict(num_hidden_layers=7, layer_types=None,
                                   tie_word_embeddings=True)),
    "phi3_longrope": ("phi3_longrope", dict(sliding_window=64)),
    "phi4_partial_rotary": ("phi4_partial_rotary", {}),
    "llama3_rope": ("llama3_rope_tied", {}),  # rope_freqs: divisors past position 64 too
    "llama_yarn": ("llama_yarn", {}),
    "qwen2_linear": ("qwen2_bias", dict(rope_parameters={"rope_type": "linear", "factor": 4.0,
                                                         "rope_theta": 10000.0})),
}


@pytest.fixture(scope="module")
def gguf_variant(tmp_path_factory):
    """name, quant mapping or None -> (the tiny HF model, its GGUF), built once per module."""
    root = tmp_path_factory.mktemp("gguf_variants")

    def get(name: str, quant=None):
        arch, overrides = GGUF_VARIANTS[name]
        src = root / name
        if not src.exists():
            make_tiny_model(arch, src, **overrides)
        tag = "-".join(f"{v}" for v in (quant or {}).values()) or "f32"
        return src, write_gguf(src, root / f"{name}-{tag}.gguf", quant=quant)

    return get


@pytest.mark.parametrize("name", list(GGUF_VARIANTS))
@torch.inference_mode()
def test_gguf_logits_and_greedy_tokens_match_the_hf_original(name, gguf_variant):
    """Llama (Q/K rows interleaved), Qwen2 / 3, Gemma 2 / 3 (norms stored as 1 + w, sandwich
    norms, window pattern derived), Phi-3 /
    Phi-4-mini (fused tensors, LongRoPE factors as tensors, partial rotary) and the rope
    rules a file states (Llama 3's rope_freqs, YaRN and linear keys) give the original's
    logits, past the rules' original contexts (64 and 256 tokens), and its greedy tokens."""
    src, path = gguf_variant(name)
    hf = load_hf(src)
    model, _ = load_model(path, "float32")
    lengths = [9, 30, 1, 300]
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(3, VOCAB_SIZE, (n,), generator=g) for n in lengths]
    ours = model.compute_logits(model(torch.cat(seqs), AttentionMetadata.for_full_sequences(
        lengths)))
    ref = torch.cat([hf(s[None]).logits[0] for s in seqs])
    assert (ours - ref).abs().max().item() <= 1e-4
    prompt = seqs[1]
    expected = hf.generate(prompt[None], max_new_tokens=8, do_sample=False, eos_token_id=None,
                           pad_token_id=0)[0, len(prompt):].tolist()
    assert generate_by_recompute(model, prompt.tolist(), 8) == expected


@pytest.mark.parametrize("name,quant", [("phi3_longrope", "Q8_0"), ("phi3_longrope", "Q4_K_M"),
                                        ("gemma3", "Q8_0"), ("gemma2", "Q4_0")])
@torch.inference_mode()
def test_quantized_gemma_and_phi3_ggufs_stay_in_their_blocks(name, quant, gguf_variant):
    """Phi-3's fused qkv / gate_up tensors and the Gemmas' linears load as blocks (none
    dequantized once the CPU kernels are in) and compute the dequantized weights' logits."""
    from kvray.kernels.plan import choose_kernel_plan
    from kvray.models.kernel_install import install_kernel_plan
    from kvray.models.quantized import quantized_modules
    from tests.helpers.tiny_gguf import Q4_K_M, dequantized_reference

    mapping = Q4_K_M if quant == "Q4_K_M" else {"*": quant}
    src, path = gguf_variant(name, mapping)
    model, _ = load_model(path, "float32")
    held = {n.rsplit(".", 1)[-1] for n, m in model.named_modules()
            if getattr(m, "quant", None) is not None}
    assert {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"} <= held
    ids = torch.randint(3, VOCAB_SIZE, (12,), generator=torch.Generator().manual_seed(0))
    meta = AttentionMetadata.for_full_sequences([12])
    want = dequantized_reference(src, mapping)(ids[None]).logits[0]
    torch.testing.assert_close(model.compute_logits(model(ids, meta)), want, rtol=0,
                               atol=1e-4)
    plan = choose_kernel_plan("auto", torch.device("cpu"), torch.float32, None, 1)
    installed = install_kernel_plan(model, plan).quantized
    assert installed.dequantized == 0 and all(m.qweight is not None
                                              for m in quantized_modules(model))
    err = model.compute_logits(model(ids, meta)) - want
    assert err.abs().max().item() <= 0.2 * want.std().item()


def test_quantization_gguf_names_a_gguf_file_and_other_format_names_are_errors(
        tiny_model_dir, tmp_path):
    """vLLM's ``--quantization gguf`` loads the file as stored; a format it is not in is an
    error naming both."""
    gguf_path = write_gguf(tiny_model_dir("llama_gqa"), tmp_path / "m.gguf")
    model, _ = load_model(gguf_path, "float32", quantization="gguf")
    assert model.spec.num_layers == 3
    with pytest.raises(ValueError, match="quantization = 'gptq'.*is gguf"):
        load_model(gguf_path, "float32", quantization="gptq")


def test_int8_over_a_gguf_quantized_throughout_says_it_runs_as_stored(
        tiny_model_dir, tmp_path, caplog):
    """Regression: ``quantization: int8`` on a Q8_0 file changed nothing, silently."""
    q8 = write_gguf(tiny_model_dir("llama_gqa"), tmp_path / "q8.gguf", quant={"*": "Q8_0"})
    with caplog.at_level("WARNING", logger="kvray"):
        load_model(q8, "float32", quantization="int8")
    assert "every linear of" in caplog.text and "already quantized as stored (gguf)" \
        in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="kvray"):  # an F32 file: quantized online
        load_model(write_gguf(tiny_model_dir("llama_gqa"), tmp_path / "f32.gguf"), "float32",
                   quantization="int8")
    assert "already quantized" not in caplog.text


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
    # regression: a ZeroDivisionError
    ("llama.attention.head_count", 0, "'llama.attention.head_count' = 0: must be at least 1"),
    ("llama.attention.head_count_kv", 0, "head_count_kv' = 0: must be at least 1"),
])
def test_gguf_with_missing_or_per_layer_metadata_names_the_key(tmp_path, drop, value,
                                                               message):
    """Regression: a GGUF lacking a required key (or holding a per-layer array) failed with
    a bare TypeError; it is an UnsupportedModelError naming the key."""
    from kvray.models.gguf_loader import GGUFCheckpoint
    from kvray.models.spec import UnsupportedModelError

    keys = {k: v for k, v in _BARE_KEYS.items() if k != drop}
    if value is not None:
        keys[drop] = value
    with pytest.raises(UnsupportedModelError, match=message):
        GGUFCheckpoint(bare_llama_gguf(tmp_path / "bad.gguf", keys))


@pytest.mark.parametrize("rope,message", [
    ({"llama.rope.scaling.type": "longrope"},
     "'llama.rope.scaling.type' = 'longrope' is not supported"),
    ({"llama.rope.scaling.type": "yarn"}, "without 'llama.rope.scaling.factor'"),
    ({"rope_freqs.weight": np.ones(3, np.float32)},
     "'rope_freqs.weight' holds 3 factors for a rotary dim of 8"),
])
def test_gguf_rope_rules_kvray_cannot_apply_are_errors_naming_the_key(tmp_path, rope, message):
    """A rope rule is never dropped silently: an unknown scaling type, a rule without its
    factor or rope factors that do not fit the heads name what is wrong."""
    from kvray.models.gguf_loader import GGUFCheckpoint
    from kvray.models.spec import UnsupportedModelError

    with pytest.raises(UnsupportedModelError, match=message):
        GGUFCheckpoint(bare_llama_gguf(tmp_path / "rope.gguf", {**_BARE_KEYS, **rope}))


def test_gguf_tensor_types_are_read_or_refused_up_front_naming_the_tensor(tmp_path):
    """F64 tensors are read as numbers; a type nothing can dequantize (I32) is refused when
    the file opens, naming the tensor (regression: gguf's bare NotImplementedError from
    deep inside loading, without the name)."""
    import gguf

    from kvray.models.gguf_loader import GGUFCheckpoint
    from kvray.models.spec import UnsupportedModelError

    values = np.linspace(-1, 1, 32 * 32).reshape(32, 32)
    ckpt = GGUFCheckpoint(bare_llama_gguf(tmp_path / "f64.gguf", {
        **_BARE_KEYS, "blk.0.attn_q.weight": (values, gguf.GGMLQuantizationType.F64)}))
    weights = dict(ckpt.iter_weights())
    assert weights["model.layers.0.self_attn.q_proj.weight"].shape == (32, 32)
    with pytest.raises(UnsupportedModelError, match="'blk.0.attn_q.weight' is stored as I32"):
        GGUFCheckpoint(bare_llama_gguf(tmp_path / "i32.gguf", {
            **_BARE_KEYS, "blk.0.attn_q.weight": (np.zeros((32, 32), np.int32),
                                                  gguf.GGMLQuantizationType.I32)}))


# the few keys a llama GGUF needs to be read (a 2-layer, 32-wide stub, no weights)
_BARE_KEYS = {"llama.block_count": 2, "llama.embedding_length": 32,
              "llama.feed_forward_length": 64, "llama.attention.head_count": 4}
