"""Pre-quantized Hugging Face checkpoints (AWQ, GPTQ, FP8, compressed-tensors) and online
int8 read into QuantTensor exactly: each expected weight is dequantized here with numpy from
the *packed* checkpoint tensors, following each format's documented bit order, and must
equal ``QuantTensor.dequantize()`` bit for bit in fp32."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from kvray.quant.blob import from_blob, to_blob
from kvray.quant.hf_formats import (
    QuantizedCheckpointError,
    UnsupportedQuantizationError,
    checkpoint_quantization,
    convert_prequantized,
)
from kvray.quant.online import quantize_int8
from kvray.quant.tensor import QuantKind, QuantTensor, gather_input
from tests.helpers.quant_checkpoints import (
    AWQ_ORDER,
    quantization_config,
    quantize_linear,
)

pytestmark = pytest.mark.unit


# ---- independent numpy readers of the packed tensors ----------------------------------------

def unpack(words: torch.Tensor | np.ndarray, bits: int) -> np.ndarray:
    """Along the last axis: value j * pack + i = bits [i * bits, (i + 1) * bits) of word j."""
    u = np.asarray(words).view(np.uint32).astype(np.int64)
    pack, mask = 32 // bits, (1 << bits) - 1
    out = np.zeros((*u.shape[:-1], u.shape[-1] * pack), np.int64)
    for i in range(pack):
        out[..., i::pack] = (u >> (bits * i)) & mask
    return out


def awq_reference(t: dict[str, torch.Tensor], group: int) -> np.ndarray:
    def columns(words):  # nibble i of word j is column 8j + AWQ_ORDER[i]
        pos = unpack(words, 4)
        out = np.empty_like(pos)
        for i, col in enumerate(AWQ_ORDER):
            out[:, col::8] = pos[:, i::8]
        return out

    q, z = columns(t["qweight"]), columns(t["qzeros"])  # [K, N], [K/G, N]
    s = t["scales"].numpy().astype(np.float32)
    g = q.shape[0] if group == -1 else group
    rows = np.arange(q.shape[0]) // g
    return ((q - z[rows]).astype(np.float32) * s[rows]).T


def gptq_reference(t: dict[str, torch.Tensor], bits: int, v2: bool) -> np.ndarray:
    q = unpack(t["qweight"].numpy().T, bits).T  # [K, N], packed along K
    n = q.shape[1]
    z = unpack(t["qzeros"], bits)[:, :n] + (0 if v2 else 1)  # v1 stores zero - 1
    s = t["scales"].numpy().astype(np.float32)
    g = t["g_idx"].numpy()
    return ((q - z[g]).astype(np.float32) * s[g]).T


def ct_packed_reference(t: dict[str, torch.Tensor], bits: int) -> np.ndarray:
    n, k = t["weight_shape"].tolist()
    half = 1 << (bits - 1)
    q = unpack(t["weight_packed"], bits)[:, :k] - half
    s = t["weight_scale"].to(torch.float32).numpy()
    zp = np.zeros_like(s, dtype=np.int64)
    if "weight_zero_point" in t:
        zp = unpack(t["weight_zero_point"].numpy().T, bits).T[:n] - half
    cols = np.arange(k) // (k // s.shape[1])  # groups of equal size along K
    return (q - zp[:, cols]).astype(np.float32) * s[:, cols]


def fp8_reference(t: dict[str, torch.Tensor], block: tuple[int, int]) -> np.ndarray:
    w = t["weight"].to(torch.float32).numpy()
    s = t.get("weight_scale_inv", t.get("weight_scale")).numpy()
    n, k = w.shape
    if s.size == 1:
        return w * s.reshape(())
    if s.shape == (n, 1):
        return w * s
    bn, bk = block
    return w * s[np.arange(n)[:, None] // bn, np.arange(k)[None, :] // bk]


def convert_one(tensors: dict[str, torch.Tensor], config: dict,
                prefix: str = "model.layers.0.mlp.down_proj") -> QuantTensor:
    scheme = checkpoint_quantization({"quantization_config": config})
    out = dict(convert_prequantized(iter((f"{prefix}.{k}", v) for k, v in tensors.items()),
                                    scheme))
    assert list(out) == [f"{prefix}.weight"]
    return out[f"{prefix}.weight"]


def random_weight(n: int, k: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((n, k)) * 0.05).astype(np.float32)


def assert_exact(qt: QuantTensor, expected: np.ndarray) -> None:
    got = qt.dequantize()
    assert got.dtype == torch.float32 and tuple(got.shape) == expected.shape
    diff = (got - torch.from_numpy(expected)).abs().max().item()
    assert torch.equal(got, torch.from_numpy(expected.astype(np.float32))), f"max diff {diff}"


# ---- AWQ, GPTQ, compressed-tensors int ------------------------------------------------------

@pytest.mark.parametrize("n,k,group", [(64, 128, 32), (96, 256, 64), (64, 256, 128),
                                       (96, 128, -1)])
def test_awq_dequantizes_bit_exactly_as_the_packed_checkpoint(n, k, group):
    tensors, twin = quantize_linear(random_weight(n, k), "awq", group=group)
    qt = convert_one(tensors, quantization_config("awq", group=group))
    expected = awq_reference(tensors, group)
    assert_exact(qt, expected)
    np.testing.assert_array_equal(expected, twin)  # the writer and this reader agree
    assert qt.kinds == (QuantKind.U4,) and qt.input_perm is None and "AWQ" in qt.source


GPTQ_CASES = [  # n, k, bits, group, sym, desc_act, v2
    (64, 128, 4, 32, True, False, False),
    (96, 256, 4, 128, False, False, False),
    (64, 256, 4, 64, False, True, False),
    (96, 128, 4, -1, True, False, True),
    (96, 256, 4, 128, True, True, True),
    (64, 128, 8, 32, True, False, False),
    (96, 256, 8, 64, False, True, False),
    (64, 128, 8, -1, False, False, True),
    (64, 160, 4, 64, False, True, False),  # K not a multiple of the group: a partial group
]


@pytest.mark.parametrize("n,k,bits,group,sym,desc_act,v2", GPTQ_CASES)
def test_gptq_dequantizes_bit_exactly_as_the_packed_checkpoint(n, k, bits, group, sym,
                                                                desc_act, v2):
    tensors, twin = quantize_linear(random_weight(n, k, seed=k + n), "gptq", bits=bits,
                                    group=group, sym=sym, desc_act=desc_act, v2=v2)
    config = quantization_config("gptq", bits=bits, group=group, sym=sym, desc_act=desc_act,
                                 v2=v2)
    qt = convert_one(tensors, config)
    expected = gptq_reference(tensors, bits, v2)
    assert_exact(qt, expected)
    np.testing.assert_array_equal(expected, twin)
    assert qt.kinds == ((QuantKind.U4,) if bits == 4 else (QuantKind.S8,))
    assert (qt.input_perm is not None) == (desc_act and group != -1)


def test_gptq_act_order_stores_each_group_contiguously():
    tensors, _ = quantize_linear(random_weight(64, 256), "gptq", bits=4, group=64,
                                 desc_act=True)
    qt = convert_one(tensors, quantization_config("gptq", group=64, desc_act=True))
    perm = qt.input_perm
    g_idx = tensors["g_idx"].long()
    assert torch.equal(g_idx[perm], torch.arange(256) // 64)  # stored column j: group j // 64
    assert qt.segments[0].group == 64
    x = torch.randn(3, 256)
    stored = qt.segments[0].dequantize()
    torch.testing.assert_close(x[:, perm] @ stored.T, x @ qt.dequantize().T)


@pytest.mark.parametrize("bits,group,sym", [(4, 32, False), (4, 128, True), (8, 64, False),
                                            (8, 128, True)])
@pytest.mark.parametrize("tp", [2, 3])
def test_act_order_weights_split_their_columns_for_tensor_parallelism(cpu_kernels, bits, group,
                                                                      sym, tp):
    """A row-parallel layer of an act-order GPTQ checkpoint (its stored columns sorted by
    group): each rank's columns fall in runs of any size inside the groups. Its shard still
    holds exactly those columns' weights, quantized, and the kernels' product over them is
    the dense slice's (the runs' padding reads zeros)."""
    n, k = 40, 384
    tensors, _ = quantize_linear(random_weight(n, k, seed=group + bits), "gptq", bits=bits,
                                 group=group, sym=sym, desc_act=True)
    qt = convert_one(tensors, quantization_config("gptq", bits=bits, group=group, sym=sym,
                                                  desc_act=True))
    assert qt.input_perm is not None
    dense = qt.dequantize()
    assert dense.is_contiguous()
    x = torch.randn(6, k, generator=torch.Generator().manual_seed(1))
    size, padded = k // tp, 0
    for r in range(tp):
        cols = slice(r * size, (r + 1) * size)
        piece = qt.narrow(1, r * size, size)
        assert piece.shape == (n, size) and piece.kinds == qt.kinds
        assert piece.stored_k % 32 == 0 and piece.stored_k >= size
        assert torch.equal(piece.dequantize(), dense[:, cols])
        assert piece.dequantize().is_contiguous()
        want = x[:, cols].double() @ dense[:, cols].double().T
        stored = torch.cat([s.dequantize() for s in piece.segments]).double()
        gathered = gather_input(x[:, cols], piece.input_perm)
        torch.testing.assert_close(gathered.double() @ stored.T, want)
        got = cpu_kernels.quantized_linear(x[:, cols], to_blob(piece), None, piece.input_perm)
        # activations quantized per block of 32: a few steps of their int8 grid
        assert (got.double() - want).abs().max() < 0.02 * want.abs().max()
        assert torch.equal(from_blob(to_blob(piece)).dequantize(), stored.float())
        padded += piece.stored_k > size
    assert padded  # the runs did not all come in whole blocks


def test_gptq_symmetric_int8_needs_no_mins():
    tensors, _ = quantize_linear(random_weight(64, 128), "gptq", bits=8, group=32, sym=True)
    qt = convert_one(tensors, quantization_config("gptq", bits=8, group=32, sym=True))
    assert qt.segments[0].mins is None


@pytest.mark.parametrize("n,k,bits,group,sym", [(64, 128, 4, 32, True), (96, 256, 4, 128, False),
                                                (64, 256, 4, -1, False), (96, 128, 8, 64, True),
                                                (64, 128, 8, -1, False)])
def test_compressed_tensors_pack_quantized_dequantizes_bit_exactly(n, k, bits, group, sym):
    tensors, twin = quantize_linear(random_weight(n, k, seed=3), "ct-int", bits=bits,
                                    group=group, sym=sym)
    qt = convert_one(tensors, quantization_config("ct-int", bits=bits, group=group, sym=sym))
    expected = ct_packed_reference(tensors, bits)
    assert_exact(qt, expected)
    np.testing.assert_array_equal(expected, twin)


def _ct_int8_config() -> dict:
    config = quantization_config("ct-int", bits=8, group=-1, sym=True)
    config["format"] = "int-quantized"  # W8A8 int8: the codes stored as int8 tensors
    return config


def test_compressed_tensors_int8_weights_dequantize_bit_exactly():
    rng = np.random.default_rng(4)
    q = rng.integers(-128, 128, (96, 160)).astype(np.int8)
    s = torch.rand(96, 1).to(torch.bfloat16)
    tensors = {"weight": torch.from_numpy(q), "weight_scale": s,
               "weight_zero_point": torch.zeros(96, 1, dtype=torch.int8),  # symmetric: zeros
               "input_scale": torch.tensor([0.02])}
    qt = convert_one(tensors, _ct_int8_config())
    assert_exact(qt, q.astype(np.float32) * s.float().numpy())
    assert qt.kinds == (QuantKind.S8,) and qt.segments[0].mins is None


def test_non_zero_zero_points_in_a_symmetric_checkpoint_are_an_error():
    tensors = {"weight": torch.ones(32, 64, dtype=torch.int8),
               "weight_scale": torch.ones(32, 1),
               "weight_zero_point": torch.ones(32, 1, dtype=torch.int8)}
    with pytest.raises(QuantizedCheckpointError, match="symmetric"):
        convert_one(tensors, _ct_int8_config())


# ---- FP8 ----------------------------------------------------------------------------------

@pytest.mark.parametrize("strategy", ["tensor", "channel", "block"])
@pytest.mark.parametrize("n,k", [(64, 128), (96, 256), (200, 300)])
def test_compressed_tensors_fp8_dequantizes_bit_exactly(strategy, n, k):
    tensors, twin = quantize_linear(random_weight(n, k, seed=5), "ct-fp8", strategy=strategy)
    qt = convert_one(tensors, quantization_config("ct-fp8", strategy=strategy))
    expected = fp8_reference(tensors, (128, 128))
    assert_exact(qt, expected)
    np.testing.assert_array_equal(expected, twin)
    assert qt.kinds == (QuantKind.F8,)


@pytest.mark.parametrize("n,k,block", [(256, 384, (128, 128)), (200, 300, (128, 128)),
                                       (96, 64, (128, 128)), (130, 192, (64, 96))])
def test_fp8_block_scales_become_exact_per_row_groups(n, k, block):
    tensors, twin = quantize_linear(random_weight(n, k, seed=7), "fp8", block=block)
    assert "weight_scale_inv" in tensors
    qt = convert_one(tensors, quantization_config("fp8", block=block))
    expected = fp8_reference(tensors, block)
    assert_exact(qt, expected)
    np.testing.assert_array_equal(expected, twin)
    group = qt.segments[0].group  # a divisor of the block, or one group per row
    assert group == qt.k_padded or block[1] % group == 0


def test_fp8_checkpoint_with_per_tensor_scale_and_static_input_scale():
    tensors, _ = quantize_linear(random_weight(64, 128), "ct-fp8", strategy="tensor")
    tensors["input_scale"] = torch.tensor([0.01])  # static activation scale: not used
    config = {"quant_method": "fp8", "activation_scheme": "static"}
    assert_exact(convert_one(tensors, config), fp8_reference(tensors, (128, 128)))


# ---- streaming: order, shards, dense pass-through, errors ------------------------------------

def test_modules_arriving_interleaved_in_any_order_are_all_converted():
    config = quantization_config("gptq", bits=4, group=32, desc_act=True)
    scheme = checkpoint_quantization({"quantization_config": config})
    stream, expected = [], {}
    for i, proj in enumerate(["self_attn.q_proj", "self_attn.o_proj", "mlp.up_proj"]):
        tensors, _ = quantize_linear(random_weight(64, 128, seed=i), "gptq", group=32,
                                     desc_act=True, seed=i)
        prefix = f"model.layers.{i}.{proj}"
        stream += [(f"{prefix}.{leaf}", t) for leaf, t in tensors.items()]
        stream.append((f"{prefix}.bias", torch.zeros(64)))
        expected[f"{prefix}.weight"] = gptq_reference(tensors, 4, False)
    dense = {"model.embed_tokens.weight": torch.randn(10, 64), "model.norm.weight": torch.ones(64),
             "lm_head.weight": torch.randn(10, 64)}
    stream += list(dense.items())
    random.Random(0).shuffle(stream)
    out = dict(convert_prequantized(iter(stream), scheme))
    assert set(out) == set(expected) | set(dense) | {n.replace("weight", "bias")
                                                      for n in expected}
    for name, ref in expected.items():
        assert_exact(out[name], ref)
    for name, t in dense.items():
        assert out[name] is t


def test_a_module_missing_a_tensor_is_an_error_naming_it():
    tensors, _ = quantize_linear(random_weight(64, 128), "awq", group=32)
    del tensors["qzeros"]
    with pytest.raises(QuantizedCheckpointError, match=r"mlp\.down_proj\.qzeros"):
        convert_one(tensors, quantization_config("awq", group=32))


@pytest.mark.parametrize("fmt,key", [("awq", "qweight"), ("awq", "qzeros"),
                                     ("gptq", "qweight"), ("gptq", "qzeros")])
def test_packed_codes_in_another_dtype_are_an_error_not_a_misread(fmt, key):
    """Regression: a float32 qweight (a converter that cast every tensor) had its bytes
    read as codes, weights off by up to 0.19."""
    tensors, _ = quantize_linear(random_weight(64, 128), fmt, group=32)
    tensors[key] = tensors[key].float()
    with pytest.raises(QuantizedCheckpointError, match="not int32 words"):
        convert_one(tensors, quantization_config(fmt, group=32))


def test_a_g_idx_of_another_group_size_names_the_group_size_not_act_order():
    tensors, _ = quantize_linear(random_weight(64, 128), "gptq", group=32, desc_act=False)
    tensors = {"g_idx": tensors.pop("g_idx"), **tensors}  # read before the scales
    with pytest.raises(QuantizedCheckpointError, match="groups the input columns by 32 but "
                                                       "quantization_config says group_size 64"):
        convert_one(tensors, quantization_config("gptq", group=64, desc_act=False))


def test_act_order_g_idx_without_desc_act_in_the_config_is_an_error():
    tensors, _ = quantize_linear(random_weight(64, 128), "gptq", group=32, desc_act=True)
    with pytest.raises(QuantizedCheckpointError, match="desc_act"):
        convert_one(tensors, quantization_config("gptq", group=32, desc_act=False))


def test_inconsistent_shapes_are_an_error_naming_the_module():
    tensors, _ = quantize_linear(random_weight(64, 128), "awq", group=32)
    tensors["scales"] = tensors["scales"][:2]
    with pytest.raises(QuantizedCheckpointError, match="down_proj"):
        convert_one(tensors, quantization_config("awq", group=32))


def test_more_scale_groups_than_the_group_size_gives_are_an_error_not_a_misread():
    """Scales of groups of 32 read as groups of 128 (a per-module override the config does
    not carry) would spread the first groups' scales over every column."""
    tensors, _ = quantize_linear(random_weight(64, 256), "gptq", bits=4, group=32, sym=True,
                                 desc_act=False)
    tensors.pop("g_idx", None)
    with pytest.raises(QuantizedCheckpointError, match="8 groups of scales for 256 columns "
                                                       "in groups of 128"):
        convert_one(tensors, quantization_config("gptq", bits=4, group=128, sym=True))


@pytest.mark.parametrize("shape", [(64, 160), (64, 96), (48, 128)])
def test_a_weight_shape_the_packed_codes_do_not_cover_is_an_error_naming_it(shape):
    """Regression: a weight_shape wider than weight_packed loaded without a word (the
    codes decided the width), so a file contradicting itself was never flagged."""
    tensors, _ = quantize_linear(random_weight(64, 128), "ct-int", bits=4, group=32)
    tensors["weight_shape"] = torch.tensor(shape)
    with pytest.raises(QuantizedCheckpointError, match=r"down_proj .*weight_shape "
                                                       rf"\[{shape[0]}, {shape[1]}\]"):
        convert_one(tensors, quantization_config("ct-int", bits=4, group=32))


def test_an_fp8_weight_in_another_dtype_is_named_with_its_dtype_not_as_missing():
    tensors, _ = quantize_linear(random_weight(64, 128), "ct-fp8", strategy="channel")
    tensors["weight"] = tensors["weight"].to(torch.float16)
    with pytest.raises(QuantizedCheckpointError, match=r"down_proj\.weight' is float16, not "
                                                       "the format's quantized dtype"):
        convert_one(tensors, quantization_config("ct-fp8", strategy="channel"))


@pytest.mark.parametrize("fmt", ["gptq", "awq", "fp8"])
def test_a_quantization_config_over_dense_weights_only_is_an_error(fmt):
    """vLLM refuses such a checkpoint too; loading it dense would hide a broken export."""
    scheme = checkpoint_quantization({"quantization_config": quantization_config(fmt)})
    stream = [("model.layers.0.mlp.down_proj.weight", torch.randn(64, 128)),
              ("model.norm.weight", torch.ones(64))]
    with pytest.raises(QuantizedCheckpointError, match="holds no quantized module"):
        list(convert_prequantized(iter(stream), scheme))


def test_a_g_idx_naming_groups_the_scales_do_not_have_is_an_error_naming_g_idx():
    tensors, _ = quantize_linear(random_weight(64, 128), "gptq", group=32, desc_act=True)
    tensors["g_idx"] = tensors["g_idx"] * 3
    with pytest.raises(QuantizedCheckpointError, match="g_idx names groups 0..9 but the "
                                                       "scales have 4"):
        convert_one(tensors, quantization_config("gptq", group=32, desc_act=True))


def test_compressed_tensors_int8_with_one_scale_per_tensor_dequantizes_bit_exactly():
    rng = np.random.default_rng(5)
    q = rng.integers(-128, 128, (64, 96)).astype(np.int8)
    config = _ct_int8_config()
    config["config_groups"]["group_0"]["weights"]["strategy"] = "tensor"
    tensors = {"weight": torch.from_numpy(q), "weight_scale": torch.tensor([0.03])}
    qt = convert_one(tensors, config)
    assert_exact(qt, q.astype(np.float32) * np.float32(0.03))


@pytest.mark.parametrize("config,key", [
    ({"quant_method": "bitsandbytes"}, "quant_method"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "version"),
    ({"quant_method": "awq", "bits": 3, "group_size": 128}, "bits"),
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "bits"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 100}, "group_size"),
    ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, "checkpoint_format"),
    ({"quant_method": "gptq", "bits": 4, "pack_dtype": "int16"}, "pack_dtype"),
    ({"quant_method": "fp8", "fmt": "e5m2"}, "fmt"),
    ({**quantization_config("ct-fp8"), "format": "naive-quantized"}, "format"),
    ({**quantization_config("ct-int"), "quantization_status": "frozen"}, "quantization_status"),
    # GPTQModel's per-module overrides of the scheme (a second scheme)
    ({"quant_method": "gptq", "bits": 4, "group_size": 128,
      "dynamic": {r"+:.*down_proj.*": {"group_size": 32}}}, r"dynamic\['\+:"),
    # rotations around the linears (QuIP / SpinQuant) that kvray does not apply
    ({**quantization_config("ct-int"), "transform_config": {"config_groups": {"u": {}}}},
     "transform_config"),
])
def test_unsupported_quantization_configs_are_errors_naming_the_key(config, key):
    with pytest.raises(UnsupportedQuantizationError, match=rf"quantization_config\.{key}"):
        checkpoint_quantization({"quantization_config": config})


def test_unquantized_config_has_no_scheme():
    assert checkpoint_quantization({"architectures": ["LlamaForCausalLM"]}) is None


def test_gptqmodel_overrides_that_only_leave_modules_out_are_read():
    """``-:`` patterns keep modules dense (stored as plain weights); an override that
    repeats the global values changes nothing."""
    config = {"quant_method": "gptq", "bits": 4, "group_size": 128,
              "dynamic": {r"-:.*layers\.0\.mlp\..*": {}, r"+:.*q_proj": {"bits": 4}}}
    assert checkpoint_quantization({"quantization_config": config}).group_size == 128


@pytest.mark.parametrize("groups", [{}, {"group_0": {"targets": []}},
                                    {"group_0": {"targets": ["Linear"], "weights": None,
                                                 "input_activations": {"num_bits": 8}}}])
def test_a_compressed_tensors_config_quantizing_no_weights_is_a_dense_checkpoint(groups):
    """llm-compressor's KV-cache-only checkpoints: dense weights (their k_scale / v_scale
    tensors are skipped by the loader)."""
    config = {"quant_method": "compressed-tensors", "format": "dense", "config_groups": groups,
              "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor"},
              "quantization_status": "compressed"}
    assert checkpoint_quantization({"quantization_config": config}) is None


def test_older_autogptq_and_autoawq_side_files_are_read(tmp_path):
    """Before quantization_config went into config.json, AutoGPTQ wrote quantize_config.json
    and AutoAWQ quant_config.json beside it."""
    (tmp_path / "quantize_config.json").write_text(
        '{"bits": 8, "group_size": 64, "desc_act": false, "sym": true}')
    scheme = checkpoint_quantization({}, tmp_path)
    assert (scheme.method, scheme.bits, scheme.group_size) == ("gptq", 8, 64)
    (tmp_path / "quantize_config.json").unlink()
    (tmp_path / "quant_config.json").write_text(
        '{"zero_point": true, "q_group_size": 32, "w_bit": 4, "version": "GEMM"}')
    scheme = checkpoint_quantization({}, tmp_path)
    assert (scheme.method, scheme.bits, scheme.group_size) == ("awq", 4, 32)
    (tmp_path / "quant_config.json").write_text("[1]")
    with pytest.raises(UnsupportedQuantizationError, match="quant_config.json: not a JSON"):
        checkpoint_quantization({}, tmp_path)


# ---- online int8 ----------------------------------------------------------------------------

@pytest.mark.parametrize("n,k", [(64, 128), (96, 100), (5, 33)])
def test_online_int8_matches_a_numpy_reference(n, k):
    w = random_weight(n, k, seed=11)
    w[1] = 0.0  # an all-zero row gets scale 1
    qt = quantize_int8(torch.from_numpy(w).to(torch.bfloat16))
    w32 = torch.from_numpy(w).to(torch.bfloat16).float().numpy()
    amax = np.abs(w32).max(1, keepdims=True)
    scale = np.where(amax > 0, amax / np.float32(127), np.float32(1)).astype(np.float32)
    codes = np.clip(np.round(w32 / scale), -127, 127)
    seg = qt.segments[0]
    assert seg.kind == QuantKind.S8 and seg.group == qt.k_padded and seg.mins is None
    np.testing.assert_array_equal(seg.scales.numpy(), scale)
    np.testing.assert_array_equal(seg.int_codes()[:, :k].numpy(), codes)
    assert not seg.int_codes()[:, k:].any()  # padding codes are zero
    err = np.abs(qt.dequantize().numpy() - w32)
    assert (err <= scale * (0.5 + 1e-4)).all()  # half a step, plus the product's rounding


def test_quantized_weights_survive_the_blob():
    tensors, _ = quantize_linear(random_weight(96, 256), "gptq", bits=8, group=64, sym=False)
    qt = convert_one(tensors, quantization_config("gptq", bits=8, group=64, sym=False))
    assert torch.equal(from_blob(to_blob(qt)).dequantize(), qt.dequantize())


@pytest.mark.parametrize("method,options", [("ct-fp8", dict(strategy="channel")),
                                            ("ct-fp8", dict(strategy="tensor")),
                                            ("gptq", dict(bits=4, group=-1, sym=False)),
                                            ("ct-int", dict(bits=8, group=-1, sym=True))])
def test_per_channel_weights_split_their_columns_on_any_block_for_tensor_parallelism(
        method, options):
    """A row-parallel layer (o_proj, down_proj) splits K over the ranks: one scale per row
    must not stop it, as it would if that one group had to stay whole."""
    tensors, _ = quantize_linear(random_weight(64, 192, seed=2), method, **options)
    qt = convert_one(tensors, quantization_config(method, **options))
    dense = qt.dequantize()
    for start, length in [(0, 96), (96, 96), (64, 128), (160, 32)]:
        piece = qt.narrow(1, start, length)
        assert piece.shape == (64, length)
        assert torch.equal(piece.dequantize(), dense[:, start:start + length])
