"""Pre-quantized Hugging Face checkpoints (AWQ, GPTQ, FP8, compressed-tensors) end to end: a
tiny model quantized by ``tests/helpers/quant_checkpoints.py`` loads into kvray holding
exactly its dequantized weights, and ``kvray.LLM`` on it follows the same model dequantized to
fp32 greedily, diverging only where the fp32 model's top two logits nearly tie."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvray import LLM, SamplingParams
from kvray.kernels.attention import AttentionMetadata
from kvray.kernels.plan import choose_kernel_plan
from kvray.models.kernel_install import install_kernel_plan
from kvray.models.loader import load_model
from kvray.models.quantized import quantized_modules
from tests.helpers.quant_checkpoints import write_quantized_checkpoint
from tests.helpers.tiny_models import VOCAB_SIZE, load_hf

pytestmark = pytest.mark.parity

FORMATS = {  # name -> (method, options)
    "awq_g32": ("awq", dict(group=32)),
    "gptq4_g32_act_order": ("gptq", dict(bits=4, group=32, sym=False, desc_act=True)),
    "gptq8_g64_sym": ("gptq", dict(bits=8, group=64, sym=True, v2=True)),
    "ct_int4_g32_asym": ("ct-int", dict(bits=4, group=32, sym=False)),
    "ct_fp8_channel": ("ct-fp8", dict(strategy="channel")),
    "fp8_block128": ("fp8", dict(block=(128, 128))),
}
LENGTHS = [9, 30, 1]


@pytest.fixture(scope="module")
def quantized(tiny_model_dir, tmp_path_factory):
    """(arch, format) -> (quantized directory, dequantized fp32 twin), written once."""
    cache: dict[tuple[str, str], tuple] = {}

    def get(arch: str, fmt: str):
        if (arch, fmt) not in cache:
            method, options = FORMATS[fmt]
            out = tmp_path_factory.mktemp(f"{arch}_{fmt}")
            cache[arch, fmt] = write_quantized_checkpoint(tiny_model_dir(arch), out, method,
                                                          **options)
        return cache[arch, fmt]

    return get


def _install(model, backend: str | None = None) -> None:
    plan = choose_kernel_plan("auto", torch.device("cpu"), torch.float32, None, 1)
    if backend is not None:
        plan = dataclasses.replace(plan, quant_backend=backend)
    install_kernel_plan(model, plan)


@torch.inference_mode()
def _logits(model) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, VOCAB_SIZE, (n,), generator=g) for n in LENGTHS]
    return model.compute_logits(model(torch.cat(seqs), AttentionMetadata.for_full_sequences(
        LENGTHS)))


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("arch", ["llama_gqa", "qwen2_bias", "qwen3_qknorm_headdim"])
def test_a_prequantized_checkpoint_loads_exactly_its_dequantized_weights(arch, fmt, quantized):
    """Read back dequantized ('dense'), every fused QKV / gate_up, bias and tied head of the
    quantized checkpoint holds exactly the twin's fp32 weights."""
    qdir, twin = quantized(arch, fmt)
    model, _ = load_model(qdir, "float32")
    assert len(quantized_modules(model)) == 4 * 3  # qkv, o, gate_up, down of each layer
    assert all(m.quant.source for m in quantized_modules(model))
    _install(model, "dense")
    ref, _ = load_model(twin, "float32")
    _install(ref, "dense")
    torch.testing.assert_close(_logits(model), _logits(ref), rtol=0, atol=1e-5)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_kvray_llm_on_a_prequantized_checkpoint_follows_its_fp32_twin(fmt, quantized):
    """Greedy tokens of ``kvray.LLM`` on the quantized checkpoint (its CPU kernels, which
    quantize activations per block) and on the dequantized fp32 twin: where they first
    differ, the twin's logits for the two tokens must nearly tie (a GPTQ act-order weight
    read without its column permutation differs after one token, at gaps of 1-4 spreads)."""
    qdir, twin = quantized("llama_gqa", fmt)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, VOCAB_SIZE, (n,), generator=g).tolist()
               for n in (5, 17, 33, 9, 60, 2, 24, 40)]
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    outs = []
    for path in (qdir, twin):
        llm = LLM(str(path), dtype="float32", block_size=4, max_num_seqs=8,
                  num_gpu_blocks_override=256)
        outs.append([o.outputs[0].token_ids for o in llm.generate(
            [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)])
        llm.shutdown()
    hf = load_hf(twin)
    prefixes = []
    for prompt, ours, theirs in zip(prompts, *outs, strict=True):
        n = _common_prefix(ours, theirs)
        prefixes.append(n)
        if n == len(theirs):
            continue
        with torch.inference_mode():
            logits = hf(torch.tensor([prompt + theirs[:n]])).logits[0, -1]
        gap = (logits[theirs[n]] - logits[ours[n]]).item()
        # The CPU kernels' logits err by up to ~5-7 % of their spread (activations in int8),
        # so two tokens' order flips within about twice that; a wrong weight flips clear ones.
        assert gap <= 0.25 * logits.std().item(), (
            f"{fmt}: token {n} differs ({ours[n]} vs {theirs[n]}) where the fp32 twin "
            f"prefers its token by {gap:.4f} (logit spread {logits.std().item():.3f})")
    print(f"{fmt}: identical greedy prefix {prefixes}, mean {sum(prefixes) / len(prefixes):.1f}"
          f" of {params.max_tokens}")


@pytest.mark.parametrize(("fmt", "name"), [("awq_g32", "awq"), ("awq_g32", "awq_marlin"),
                                           ("gptq8_g64_sym", "gptq_marlin"),
                                           ("ct_int4_g32_asym", "compressed-tensors"),
                                           ("ct_fp8_channel", "fp8"), ("fp8_block128", "fp8")])
def test_vllms_name_for_the_checkpoints_own_format_loads_it_as_stored(fmt, name, quantized):
    """``quantization: awq`` on an AWQ checkpoint (``fp8`` on an FP8 one, on CPU too) is
    what vLLM command lines say: the weights load as stored, as with null."""
    qdir, _ = quantized("llama_gqa", fmt)
    model, _ = load_model(qdir, "float32", quantization=name)
    stored, _ = load_model(qdir, "float32")
    assert [m.quant.source for m in quantized_modules(model)] == \
        [m.quant.source for m in quantized_modules(stored)]


@pytest.mark.parametrize(("fmt", "name", "stored"), [
    ("awq_g32", "gptq", "is awq"), ("ct_fp8_channel", "awq", "compressed-tensors fp8"),
    (None, "awq", "not quantized"), (None, "gguf", "not quantized")])
def test_a_format_name_the_checkpoint_is_not_stored_in_is_an_error_naming_both(
        fmt, name, stored, quantized, tiny_model_dir):
    path = quantized("llama_gqa", fmt)[0] if fmt else tiny_model_dir("llama_gqa")
    with pytest.raises(ValueError, match=f"quantization = '{name}'.*{stored}"):
        load_model(path, "float32", quantization=name)


def _copy(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def _add_tensors(folder, tensors: dict) -> None:
    """Add ``tensors`` to a sharded checkpoint as one more shard listed in its index."""
    import json

    from safetensors.torch import save_file

    save_file(tensors, str(folder / "extra.safetensors"))
    index = folder / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    data["weight_map"].update({name: "extra.safetensors" for name in tensors})
    index.write_text(json.dumps(data))


def _assert_loads_as(path, twin) -> None:
    model, _ = load_model(path, "float32")
    _install(model, "dense")
    ref, _ = load_model(twin, "float32")
    _install(ref, "dense")
    torch.testing.assert_close(_logits(model), _logits(ref), rtol=0, atol=1e-5)


def test_autogptqs_zero_biases_on_bias_free_linears_are_skipped(quantized, tmp_path):
    """AutoGPTQ saves a zero bias for every quantized linear, also where the model has
    none (Llama); a non-zero one there is still an unexpected tensor."""
    qdir, twin = quantized("llama_gqa", "gptq8_g64_sym")
    path = _copy(qdir, tmp_path / "q")
    names = [f"model.layers.{i}.{m}.bias" for i in range(3)
             for m in ("self_attn.q_proj", "self_attn.o_proj", "mlp.down_proj")]
    _add_tensors(path, {n: torch.zeros(64, dtype=torch.float16) for n in names})
    _assert_loads_as(path, twin)
    _add_tensors(path, {names[0]: torch.ones(64, dtype=torch.float16)})
    with pytest.raises(ValueError, match="unexpected tensors.*q_proj.bias"):
        load_model(path, "float32")


@pytest.mark.parametrize(("fmt", "side_file", "settings"), [
    ("gptq8_g64_sym", "quantize_config.json",
     {"bits": 8, "group_size": 64, "sym": True, "desc_act": False,
      "checkpoint_format": "gptq_v2"}),
    ("awq_g32", "quant_config.json",
     {"zero_point": True, "q_group_size": 32, "w_bit": 4, "version": "GEMM"})])
def test_a_quantization_config_in_an_older_side_file_is_read(fmt, side_file, settings,
                                                              quantized, tmp_path):
    import json

    qdir, twin = quantized("llama_gqa", fmt)
    path = _copy(qdir, tmp_path / "q")
    config = json.loads((path / "config.json").read_text())
    del config["quantization_config"]
    (path / "config.json").write_text(json.dumps(config))
    (path / side_file).write_text(json.dumps(settings))
    _assert_loads_as(path, twin)


def test_a_kv_cache_only_compressed_tensors_checkpoint_loads_its_dense_weights(
        tiny_model_dir, tmp_path):
    """llm-compressor's KV-cache-only output: dense weights, a kv_cache_scheme and a
    k_scale / v_scale per attention layer (kvray scales its KV cache per token itself);
    with attention quantization also q_scale (and Quark's prob_scale), which vLLM loads
    (regression: "unexpected tensors")."""
    import json

    from safetensors.torch import save_file

    src = tiny_model_dir("llama_gqa")
    path = _copy(src, tmp_path / "kv_only")
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "dense", "config_groups": {},
        "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor",
                            "dynamic": False, "symmetric": True},
        "quantization_status": "compressed"}
    (path / "config.json").write_text(json.dumps(config))
    save_file({f"model.layers.{i}.self_attn.{s}": torch.tensor(0.02) for i in range(3)
               for s in ("k_scale", "v_scale", "q_scale", "prob_scale")},
              str(path / "scales.safetensors"))
    _assert_loads_as(path, src)
