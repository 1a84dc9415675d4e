"""Weight loading: sharded checkpoints, and errors that name what is wrong."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvray.kernels.attention import AttentionMetadata
from kvray.models.loader import WeightLoadError, load_model
from kvray.models.spec import UnsupportedModelError
from kvray.tokenizer import load_tokenizer
from tests.helpers.tiny_gguf import bare_llama_gguf
from tests.helpers.tiny_models import load_hf

pytestmark = pytest.mark.parity


def _copy_model(src, dst, mutate):
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(src / "model.safetensors"))
    mutate(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def test_sharded_checkpoint_with_index_loads_identically(tiny_model_dir, tmp_path):
    hf = load_hf(tiny_model_dir("llama_gqa"))
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 1
    a, _ = load_model(tiny_model_dir("llama_gqa"), "float32")
    b, _ = load_model(tmp_path / "sharded", "float32")
    for (na, pa), (nb, pb) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert na == nb and torch.equal(pa, pb)


def _as_torch_bins(src, dst, shards: int, **save_kwargs):
    """``src``'s tensors as ``torch.save`` shards (and their index when more than one), the
    way checkpoints were saved before safetensors."""
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    tensors = list(load_file(str(src / "model.safetensors")).items())
    weight_map = {}
    for i in range(shards):
        name = "pytorch_model.bin" if shards == 1 else \
            f"pytorch_model-{i + 1:05d}-of-{shards:05d}.bin"
        part = dict(tensors[i::shards])
        torch.save(part, dst / name, **save_kwargs)
        weight_map.update(dict.fromkeys(part, name))
    if shards > 1:
        (dst / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return dst


@pytest.mark.parametrize("shards,legacy", [(1, False), (3, False), (1, True)])
def test_a_pytorch_bin_checkpoint_loads_identically(tiny_model_dir, tmp_path, shards, legacy):
    """A checkpoint saved with ``torch.save`` (one ``pytorch_model.bin``, index-sharded
    ones, or the pre-zip format) loads as its safetensors twin does."""
    src = tiny_model_dir("llama_gqa")
    kwargs = {"_use_new_zipfile_serialization": False} if legacy else {}
    a, _ = load_model(src, "float32")
    b, _ = load_model(_as_torch_bins(src, tmp_path / "bin", shards, **kwargs), "float32")
    for (na, pa), (nb, pb) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert na == nb and torch.equal(pa, pb)


def test_a_pytorch_bin_that_pickles_code_or_lacks_shards_is_refused(tiny_model_dir, tmp_path):
    """``.bin`` files are read with ``weights_only``: one pickling anything but tensors (a
    way to run code at load) is a WeightLoadError naming the file, never executed; an
    index naming a missing shard names it."""
    src = tiny_model_dir("llama_gqa")
    bad = _as_torch_bins(src, tmp_path / "bad", 1)
    torch.save({"x": torch.zeros(2), "evil": print}, bad / "pytorch_model.bin")
    with pytest.raises(WeightLoadError, match="pytorch_model.bin: cannot read it"):
        load_model(bad, "float32")
    sharded = _as_torch_bins(src, tmp_path / "sharded", 2)
    (sharded / "pytorch_model-00002-of-00002.bin").unlink()
    with pytest.raises(WeightLoadError, match="missing.*00002-of-00002"):
        load_model(sharded, "float32")


def test_missing_tensor_is_named(tiny_model_dir, tmp_path):
    path = _copy_model(tiny_model_dir("llama_gqa"), tmp_path / "m",
                       lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(WeightLoadError, match=r"missing.*model\.layers\.1\.self_attn\.k_proj"):
        load_model(path, "float32")


def test_unexpected_tensor_is_named(tiny_model_dir, tmp_path):
    path = _copy_model(tiny_model_dir("llama_gqa"), tmp_path / "m",
                       lambda t: t.update({"model.extra.weight": torch.zeros(2)}))
    with pytest.raises(WeightLoadError, match=r"unexpected.*model\.extra\.weight"):
        load_model(path, "float32")


def test_mismatched_shape_is_named(tiny_model_dir, tmp_path):
    def shrink(t):
        t["model.layers.0.mlp.down_proj.weight"] = torch.zeros(64, 100)

    path = _copy_model(tiny_model_dir("llama_gqa"), tmp_path / "m", shrink)
    with pytest.raises(WeightLoadError, match=r"down_proj\.weight.*\(64, 100\)"):
        load_model(path, "float32")


def test_unsupported_architecture_is_named(tiny_model_dir, tmp_path):
    path = _copy_model(tiny_model_dir("llama_gqa"), tmp_path / "m", lambda t: None)
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel.*LlamaForCausalLM"):
        load_model(path, "float32")


def _edit_config(path, **keys) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(keys)
    (path / "config.json").write_text(json.dumps(cfg))


def test_bias_keys_a_family_does_not_read_change_nothing(tiny_model_dir, tmp_path):
    """Regression: ``attention_bias`` / ``mlp_bias`` on Mistral (and Qwen2's ``qkv_bias``)
    made kvray expect bias tensors transformers never creates for those families: the
    checkpoint was refused as missing tensors."""
    path = _copy_model(tiny_model_dir("mistral"), tmp_path / "m", lambda t: None)
    _edit_config(path, attention_bias=True, mlp_bias=True)
    model, spec = load_model(path, "float32")
    assert not (spec.qkv_bias or spec.o_bias or spec.mlp_bias)
    ids = torch.tensor([[5, 9, 17, 3]])
    with torch.no_grad():
        want = load_hf(path)(ids).logits[0, -1]
    with torch.no_grad():
        got = model.compute_logits(model(ids[0], AttentionMetadata.for_full_sequences([4])))[-1]
    assert torch.allclose(got, want, atol=1e-4)
    qwen = _copy_model(tiny_model_dir("qwen2_bias"), tmp_path / "q", lambda t: None)
    _edit_config(qwen, qkv_bias=False, mlp_bias=True)
    assert load_model(qwen, "float32")[1].qkv_bias  # Qwen2's q/k/v always have biases


def test_a_tied_config_ignores_the_checkpoints_own_lm_head(tiny_model_dir, tmp_path):
    """Regression: with tie_word_embeddings set, a checkpoint's lm_head.weight was loaded
    into the shared tensor too, so whichever came last replaced the embeddings."""
    path = _copy_model(tiny_model_dir("llama_gqa"), tmp_path / "m", lambda t: None)
    _edit_config(path, tie_word_embeddings=True)
    tensors = load_file(str(path / "model.safetensors"))
    assert not torch.equal(tensors["lm_head.weight"], tensors["model.embed_tokens.weight"])
    # the head in a later shard than the embeddings: read after them
    (path / "model.safetensors").unlink()
    rest = {k: v for k, v in tensors.items() if k != "lm_head.weight"}
    save_file(rest, str(path / "model-00001-of-00002.safetensors"))
    save_file({"lm_head.weight": tensors["lm_head.weight"]},
              str(path / "model-00002-of-00002.safetensors"))
    index = {k: "model-00001-of-00002.safetensors" for k in rest}
    index["lm_head.weight"] = "model-00002-of-00002.safetensors"
    (path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": index}))
    model, _ = load_model(path, "float32")
    assert torch.equal(model.model.embed_tokens.weight, tensors["model.embed_tokens.weight"])
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_gemma3_bidirectional_attention_is_refused_naming_the_key(tmp_path):
    import transformers

    config = transformers.Gemma3TextConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        use_bidirectional_attention=True)
    transformers.Gemma3ForCausalLM(config).save_pretrained(tmp_path / "g")
    with pytest.raises(UnsupportedModelError, match="use_bidirectional_attention"):
        load_model(tmp_path / "g", "float32")


def test_missing_directory_says_nothing_is_downloaded(tmp_path):
    with pytest.raises(FileNotFoundError, match="never downloads"):
        load_model(tmp_path / "absent", "float32")
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path, "float32")


def test_max_model_len_beyond_the_model_is_rejected(tiny_model_dir):
    with pytest.raises(ValueError, match="max_model_len = 4096 exceeds"):
        load_model(tiny_model_dir("llama_gqa"), "float32", max_model_len=4096)


def test_tokenizer_and_chat_template_load_from_the_directory(tiny_model_dir):
    tok = load_tokenizer(tiny_model_dir("qwen2_bias"))
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")
    assert tok.decode(tok("Hello world")["input_ids"]) == "Hello world"


def test_auto_dtype_uses_the_checkpoint_dtype(tiny_model_dir):
    model, _ = load_model(tiny_model_dir("llama_gqa"), "auto")
    assert model.model.embed_tokens.weight.dtype == torch.float32
    out = model(torch.tensor([3, 4]), AttentionMetadata.for_full_sequences([2]))
    assert out.shape == (2, 64)


def test_a_truncated_safetensors_or_gguf_file_is_an_error_naming_it(tiny_model_dir, tmp_path):
    """Regression: a cut-off download failed with the readers' own errors (a SafetensorError
    about headers, numpy's 'cannot reshape'); each is now an error naming the file."""
    from kvray.models.spec import UnsupportedModelError
    from tests.helpers.tiny_gguf import write_gguf

    src = tiny_model_dir("llama_gqa")
    cut = _copy_model(src, tmp_path / "cut", lambda tensors: None)
    data = (cut / "model.safetensors").read_bytes()
    (cut / "model.safetensors").write_bytes(data[:len(data) // 2])
    with pytest.raises(WeightLoadError, match="model.safetensors: not a readable safetensors"):
        load_model(cut, "float32")
    gguf_path = write_gguf(src, tmp_path / "m.gguf")
    data = gguf_path.read_bytes()
    for size in (len(data) // 2, 100, 0):
        gguf_path.write_bytes(data[:size])
        with pytest.raises(UnsupportedModelError, match="m.gguf is not a readable GGUF file"):
            load_model(gguf_path, "float32")
        # the engine reads the tokenizer first: the same message, not transformers' own
        with pytest.raises(ValueError, match="m.gguf is not a readable GGUF file"):
            load_tokenizer(gguf_path)


def test_a_big_endian_gguf_is_refused_naming_the_conversion(tmp_path):
    """Regression: gguf's reader opens a big-endian file, but kvray read its tensors' bytes
    in this machine's order: every output token 0, NaN log-probs."""
    import gguf

    from kvray.models.gguf_loader import GGUFCheckpoint

    path = bare_llama_gguf(tmp_path / "big.gguf", {}, gguf.GGUFEndian.BIG)
    with pytest.raises(UnsupportedModelError, match="big.gguf is a big-endian GGUF.*"
                                                    "gguf_convert_endian.py big.gguf little"):
        GGUFCheckpoint(path)
    with pytest.raises(ValueError, match="big.gguf is a big-endian GGUF"):
        load_tokenizer(path)


def test_a_gguf_without_a_tokenizer_asks_for_one(tiny_model_dir, tmp_path):
    """Regression: transformers' "Cannot build a tokenizer from a GGUF file stating
    tokenizer None" did not say what to do."""
    path = bare_llama_gguf(tmp_path / "m.gguf", {})
    with pytest.raises(ValueError, match="m.gguf holds no tokenizer .*pass `tokenizer`"):
        load_tokenizer(path)
    assert load_tokenizer(path, tiny_model_dir("llama_gqa")).encode("hello")


@pytest.mark.parametrize("key,value,tensor", [
    ("intermediate_size", 96, "down_proj"),  # the tensors are 128 wide
    ("num_key_value_heads", 1, "k_proj"),  # the tensors hold 2 heads
    ("num_attention_heads", 2, "[qo]_proj"),  # 4 heads of 16 (head_dim given)
])
def test_tensors_larger_than_the_config_says_are_refused_not_cut_to_fit(
        tiny_model_dir, tmp_path, key, value, tensor):
    """Regression: each linear's loader narrowed the checkpoint's tensor to its own size
    and served truncated weights (transformers refuses such a checkpoint)."""
    src = tiny_model_dir("llama_gqa")
    dst = _copy_model(src, tmp_path / "m", lambda tensors: None)
    config = json.loads((dst / "config.json").read_text())
    config["head_dim"] = config["hidden_size"] // config["num_attention_heads"]
    config[key] = value
    (dst / "config.json").write_text(json.dumps(config))
    with pytest.raises(WeightLoadError, match=tensor):
        load_model(dst, "float32")
