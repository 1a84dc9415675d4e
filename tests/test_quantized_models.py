"""Quantized weights in whole models: a checkpoint's quantized tensors (a GGUF's blocks) and
online int8 reach the layers exactly (sharded, fused, tied), and the kernels that read them
give the logits of the same weights dequantized."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvray.kernels.attention import AttentionMetadata
from kvray.kernels.plan import choose_kernel_plan
from kvray.models.kernel_install import install_kernel_plan
from kvray.models.layers import RowParallelLinear, SmallMMatmul
from kvray.models.loader import load_model
from kvray.models.moe import MoEExperts
from kvray.models.quantized import QuantInstall, quantized_modules
from kvray.parallel import ParallelContext
from kvray.quant.online import quantize_int8
from kvray.quant.tensor import QuantKind, QuantSegment, QuantTensor
from tests.helpers.tiny_models import VOCAB_SIZE

pytestmark = pytest.mark.parity

LENGTHS = [9, 30, 1]


def _install(model, backend: str | None = None) -> QuantInstall:
    """The kernels a model runner would give ``model`` on this CPU; ``backend`` overrides
    what reads the quantized weights."""
    dtype = next(model.parameters()).dtype
    plan = choose_kernel_plan("auto", torch.device("cpu"), dtype, None, 1)
    if backend is not None:
        plan = dataclasses.replace(plan, quant_backend=backend)
    return install_kernel_plan(model, plan).quantized


@torch.inference_mode()
def _logits(model, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(3, VOCAB_SIZE, (n,), generator=g) for n in LENGTHS]
    meta = AttentionMetadata.for_full_sequences(LENGTHS)
    return model.compute_logits(model(torch.cat(seqs), meta))


def _int8_reference(path):
    """The dense model with every linear (and the LM head) and every MoE expert holding its
    int8-dequantized weight: what an online-int8 model computes, but through the plain fp32
    path."""
    model, _ = load_model(path, "float32")
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, SmallMMatmul) and m.weight.numel():
                m.weight.copy_(quantize_int8(m.weight.detach()).dequantize())
            if isinstance(m, MoEExperts):
                for w in (m.w13_weight, m.w2_weight):
                    for i in range(w.shape[0]):
                        w[i].copy_(quantize_int8(w[i].detach()).dequantize())
    return model


def _experts(model) -> list[MoEExperts]:
    return [m for m in model.modules() if isinstance(m, MoEExperts)]


@pytest.mark.parametrize("arch", ["llama_gqa", "llama3_rope_tied", "qwen2_bias",
                                  "qwen3_qknorm_headdim", "mixtral_moe", "qwen2_moe_shared"])
def test_online_int8_holds_exactly_the_quantized_weights(arch, tiny_model_dir):
    """Dequantized where they are read ('dense'), the online-int8 model's weights are the
    reference's: fused QKV / gate_up, biases, a tied LM head and each MoE expert land
    where they should."""
    src = tiny_model_dir(arch)
    model, _ = load_model(src, "float32", quantization="int8")
    assert len(quantized_modules(model)) >= (2 if "moe" in arch else 4) * 3 + 1
    assert all(m.quant is not None and not m.w13_weight.numel() for m in _experts(model))
    _install(model, "dense")
    ref = _int8_reference(src)
    _install(ref)
    torch.testing.assert_close(_logits(model), _logits(ref), rtol=0, atol=2e-5)


@pytest.mark.parametrize("arch", ["llama_gqa", "qwen2_bias", "qwen3_qknorm_headdim"])
def test_the_cpu_kernels_give_the_dequantized_weights_logits(arch, tiny_model_dir):
    """The C++ kernels read the int8 blobs (activations quantized per block of 32): the
    logits stay within a small fraction of their spread of the reference's (and are not
    the reference's own: the kernels ran), and greedy argmax agrees wherever the reference's
    top two are not a near-tie."""
    src = tiny_model_dir(arch)
    model, _ = load_model(src, "float32", quantization="int8")
    _install(model)
    assert all(m.qweight is not None for m in quantized_modules(model))
    ref = _int8_reference(src)
    _install(ref)
    ours, theirs = _logits(model), _logits(ref)
    spread = theirs.std().item()
    # int8 activations move each linear's output by ~1 % of its norm (the kernel tests bound
    # it per linear); through 3 layers the logits move by up to ~7 % of their spread here
    err = (ours - theirs).abs().max().item()
    assert 0 < err <= 0.12 * spread
    top2 = theirs.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 0.3 * spread
    assert clear.sum() >= len(clear) // 4  # enough rows for the argmax check to mean much
    assert torch.equal(ours.argmax(-1)[clear], theirs.argmax(-1)[clear])


@pytest.mark.parametrize("arch", ["mixtral_moe", "qwen2_moe_shared", "qwen3_moe"])
@torch.inference_mode()
def test_int8_experts_run_on_the_cpu_kernels_in_a_quarter_of_their_bytes(arch,
                                                                         tiny_model_dir):
    """``quantization: int8`` holds each MoE expert as int8 blobs (about a quarter of its
    fp32 bytes) read by the C++ kernels: a MoE layer's output on routing that leaves some
    experts without a token stays within the int8 activations' ~1-2 % of the same layer on
    the int8-dequantized experts. (Whole-model logits are no test here: a small activation
    error upstream flips near-tied top-k choices of these random routers.)"""
    src = tiny_model_dir(arch)
    model, _ = load_model(src, "float32", quantization="int8")
    installed = _install(model)
    assert installed.dequantized == 0
    ref = _int8_reference(src)
    _install(ref)
    gen = torch.Generator().manual_seed(0)
    for ours, theirs in zip(_experts(model), _experts(ref), strict=True):
        assert ours.quant_kind == "blob" and not ours.w13_weight.numel()
        fp32 = 4 * ours.num_local * 3 * ours.inter * ours.hidden
        assert fp32 / 4 < ours.held_bytes() < fp32 / 3  # int8 codes + a scale per row
        tokens, k = 7, 2
        x = torch.randn(tokens, ours.hidden, generator=gen)
        experts = torch.randint(0, ours.num_experts // 2, (tokens, k), generator=gen)
        experts[:, 1] = (experts[:, 0] + 1) % (ours.num_experts // 2)  # distinct, half idle
        weights = torch.rand(tokens, k, generator=gen)
        got, want = ours(x, weights, experts), theirs(x, weights, experts)
        rel = ((got - want).norm() / want.norm()).item()
        assert 0 < rel < 0.03, rel


def test_a_row_parallel_split_off_the_quantization_blocks_names_tensor_parallel_size():
    ctx = ParallelContext(tp_rank=0, tp_size=2)
    layer = RowParallelLinear(ctx, in_features=96, out_features=8, bias=False,
                              dtype=torch.float32)
    qt = _q8_0_like(8, 96)
    with pytest.raises(ValueError, match="tensor_parallel_size 2"):
        layer.weight_loader(layer.weight, qt)


def _q8_0_like(rows: int, cols: int) -> QuantTensor:
    """Signed 8-bit codes with a scale per block of 32 (GGUF Q8_0's layout)."""
    codes = torch.randint(-127, 128, (rows, cols), dtype=torch.int8)
    scales = torch.rand(rows, cols // 32).to(torch.float16)
    return QuantTensor((rows, cols), (QuantSegment(QuantKind.S8, 32, codes, scales),))


def test_a_row_parallel_split_on_block_boundaries_keeps_each_ranks_columns():
    qt = _q8_0_like(8, 128)
    for rank in range(2):
        layer = RowParallelLinear(ParallelContext(tp_rank=rank, tp_size=2), 128, 8, False,
                                  torch.float32)
        layer.weight_loader(layer.weight, qt)
        piece = layer.__dict__["quant_pieces"][0]
        assert isinstance(piece, QuantTensor) and piece.shape == (8, 64)
        expected = qt.dequantize()[:, 64 * rank:64 * (rank + 1)]
        torch.testing.assert_close(piece.dequantize(), expected)


def test_quantization_fp8_on_cpu_is_an_error_naming_it(tiny_model_dir):
    with pytest.raises(ValueError, match="quantization = 'fp8'"):
        load_model(tiny_model_dir("llama_gqa"), "float32", quantization="fp8")


def test_an_unknown_quantization_is_an_error_naming_it(tiny_model_dir):
    with pytest.raises(ValueError, match="quantization = 'int3'"):
        load_model(tiny_model_dir("llama_gqa"), "float32", quantization="int3")



@pytest.fixture(scope="module")
def kquant_model(tmp_path_factory):
    """A tiny Llama with K = 256 / 512 (so K-quants apply) and untied embeddings."""
    from tests.helpers.tiny_models import make_tiny_model

    return make_tiny_model("llama_gqa", tmp_path_factory.mktemp("gguf_q") / "m",
                           hidden_size=256, intermediate_size=512)


@pytest.mark.parametrize("quant", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K_M", "Q5_K_M",
                                   "Q3_K_M", "Q2_K"])
def test_a_quantized_gguf_is_held_in_its_blocks_and_read_as_their_values(quant, kquant_model,
                                                                         tmp_path):
    """A GGUF's Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1 / K-quant tensors (the embedding too) load
    without dequantizing, within 10 % of the file's bytes (Q3_K and Q2_K: their codes take
    4 bits, within 1.35x and 2x; so do the blobs the CPU kernels read), give the logits of
    their dequantized values, and the CPU kernels stay close to those."""
    from gguf import GGUFReader

    from tests.helpers import tiny_gguf
    from tests.helpers.tiny_gguf import dequantized_reference, write_gguf

    mapping = {"Q4_K_M": tiny_gguf.Q4_K_M, "Q5_K_M": tiny_gguf.Q5_K_M,
               "Q3_K_M": tiny_gguf.Q3_K_M, "Q2_K": tiny_gguf.Q2_K_MIX}.get(quant, {"*": quant})
    bound = {"Q3_K_M": 1.35, "Q2_K": 2.0}.get(quant, 1.1)
    path = write_gguf(kquant_model, tmp_path / "m.gguf", quant=mapping)
    file_bytes = sum(int(t.n_bytes) for t in GGUFReader(str(path)).tensors
                     if len(t.shape) == 2)
    model, _ = load_model(path, "float32")
    held = {id(m.quant): m.quant.nbytes for m in quantized_modules(model)}
    assert len(held) == 3 * 4 + 2  # every layer's 4 linears, the embedding, the LM head
    assert file_bytes <= sum(held.values()) <= bound * file_bytes
    with torch.inference_mode():
        ref_model = dequantized_reference(kquant_model, mapping)
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(3, VOCAB_SIZE, (12,), generator=g)
        ref = ref_model(ids[None]).logits[0]
        meta = AttentionMetadata.for_full_sequences([12])
        dense = model.compute_logits(model(ids, meta))  # before install: the reference path
        torch.testing.assert_close(dense, ref, rtol=0, atol=1e-4)
        installed = _install(model)
        assert all(m.qweight is not None for m in quantized_modules(model))
        assert installed.dequantized == 0
        assert file_bytes <= installed.bytes_held <= bound * file_bytes
        fast = model.compute_logits(model(ids, meta))
        err, spread = fast - ref, ref.std().item()
        # int8 activations: ~1 % per linear, through 3 layers and a 4-bit LM head
        assert 0 < err.abs().max().item() <= 0.2 * spread
        assert err.pow(2).mean().sqrt().item() <= 0.04 * spread


@pytest.mark.parametrize("arch,quant", [("qwen3_moe", "Q8_0"), ("qwen3_moe", "Q4_K_M"),
                                        ("mixtral_moe", "Q4_K_M"), ("qwen2_moe_shared", "Q8_0"),
                                        ("qwen2_moe_shared", "Q5_K_M")])
def test_a_moe_gguf_keeps_its_stacked_experts_quantized(arch, quant, tmp_path):
    """A Qwen3-MoE GGUF (llama.cpp's ``qwen3moe``), a Qwen2-MoE one (``qwen2moe``: a shared
    expert with its 1-D gate; here also a dense layer, found by its missing router) or a
    Mixtral one (``llama`` with an expert count; Q/K rows interleaved): experts stacked per
    layer, the router in F32.
    Every expert is held quantized (Q8_0; Q4_K_M, whose rows too short for K-quants fall
    back to Q5_0 as in llama.cpp), the model computes the dequantized reference's logits
    before the kernels are installed, and then runs its experts on the CPU kernels."""
    from gguf import GGUFReader

    from tests.helpers.tiny_gguf import Q4_K_M, Q5_K_M, dequantized_reference, write_gguf
    from tests.helpers.tiny_models import make_tiny_model

    # experts as wide as a whole number of 32-blocks, so they quantize
    widths = dict(moe_intermediate_size=64, shared_expert_intermediate_size=96) \
        if arch == "qwen2_moe_shared" else {}
    src = make_tiny_model(arch, tmp_path / "hf", **widths)
    mapping = {"Q4_K_M": Q4_K_M, "Q5_K_M": Q5_K_M}.get(quant, {"*": quant})
    path = write_gguf(src, tmp_path / "m.gguf", quant=mapping)
    types = {t.name: t.tensor_type.name for t in GGUFReader(str(path)).tensors}
    assert types["blk.0.ffn_gate_inp.weight"] == "F32"
    # rows too short for a super-block fall back as in llama.cpp (Q4_K -> Q5_0, Q5_K -> Q5_1)
    assert types["blk.0.ffn_down_exps.weight"] == {"Q8_0": "Q8_0", "Q4_K_M": "Q5_0",
                                                   "Q5_K_M": "Q5_1"}[quant]
    model, spec = load_model(path, "float32")
    num_experts = {"qwen3_moe": 8, "qwen2_moe_shared": 6}.get(arch, 4)
    assert spec.num_experts == num_experts and spec.num_experts_per_tok == 2
    experts = _experts(model)
    num_moe_layers = 2 if arch == "qwen2_moe_shared" else 3  # its layer 1 is dense
    assert len(experts) == num_moe_layers and all(
        m.quant is not None and len(m.quant) == num_experts for m in experts)
    if arch == "qwen2_moe_shared":
        assert types["blk.0.ffn_gate_inp_shexp.weight"] == "F32"
        assert "blk.1.ffn_gate_inp.weight" not in types and "blk.1.ffn_up.weight" in types
    with torch.inference_mode():
        ref = dequantized_reference(src, mapping)
        ids = torch.randint(3, VOCAB_SIZE, (12,), generator=torch.Generator().manual_seed(0))
        want = ref(ids[None]).logits[0]
        meta = AttentionMetadata.for_full_sequences([12])
        torch.testing.assert_close(model.compute_logits(model(ids, meta)), want, rtol=0,
                                   atol=1e-4)
    installed = _install(model)
    assert installed.dequantized == 0
    assert all(m.quant_kind == "blob" for m in experts)
    with torch.inference_mode():
        assert torch.isfinite(model.compute_logits(model(ids, meta))).all()


@torch.inference_mode()
def test_act_order_experts_keep_their_column_order_on_the_cpu_kernels():
    """Regression: a quantized expert stored with permuted columns (GPTQ act-order's
    ``input_perm``) read through the CPU blobs gives what its dequantized weights give;
    the blobs once dropped the permutation."""
    import dataclasses as dc

    from kvray.models.quantized import install_quantized

    hidden, inter = 64, 96
    g = torch.Generator().manual_seed(7)
    perm_h, perm_i = torch.randperm(hidden, generator=g), torch.randperm(inter, generator=g)
    layer = MoEExperts(ParallelContext(), 2, hidden, inter, torch.float32)
    for e in range(2):
        for part, shape, perm in (("gate", (inter, hidden), perm_h),
                                  ("up", (inter, hidden), perm_h),
                                  ("down", (hidden, inter), perm_i)):
            qt = dc.replace(quantize_int8(torch.randn(*shape, generator=g) * 0.2),
                            input_perm=perm)
            param = layer.w2_weight if part == "down" else layer.w13_weight
            param.weight_loader(param, qt, f"{e}.{part}")
    assert layer.assemble_quantized()
    x = torch.randn(5, hidden, generator=g)
    experts = torch.tensor([[0, 1], [1, 0], [0, 1], [1, 0], [0, 1]])
    weights = torch.rand(5, 2, generator=g)
    want = layer(x, weights, experts)  # the dequantized reference path
    plan = choose_kernel_plan("auto", torch.device("cpu"), torch.float32, None, 1)
    install_quantized(layer, plan)
    assert layer.quant_kind == "blob"
    got = layer(x, weights, experts)
    assert ((got - want).norm() / want.norm()).item() < 0.03


@torch.inference_mode()
def test_act_order_experts_split_over_tensor_parallel_ranks():
    """Act-order experts sliced over 2 TP ranks (each rank's share of the intermediate
    columns of down falls in padded runs of the stored order): each rank's blobs give what
    its dequantized slice gives, and the ranks' partial outputs add up to one rank's."""
    import dataclasses as dc

    from kvray.models.quantized import install_quantized
    from kvray.parallel import ParallelContext as Ctx

    hidden, inter = 64, 96
    g = torch.Generator().manual_seed(11)
    perm_h, perm_i = torch.randperm(hidden, generator=g), torch.randperm(inter, generator=g)
    mats = {(e, part): dc.replace(quantize_int8(torch.randn(*shape, generator=g) * 0.2),
                                  input_perm=perm)
            for e in range(2)
            for part, shape, perm in (("gate", (inter, hidden), perm_h),
                                      ("up", (inter, hidden), perm_h),
                                      ("down", (hidden, inter), perm_i))}
    x = torch.randn(5, hidden, generator=g)
    experts = torch.tensor([[0, 1], [1, 0], [0, 1], [1, 0], [0, 1]])
    weights = torch.rand(5, 2, generator=g)
    plan = choose_kernel_plan("auto", torch.device("cpu"), torch.float32, None, 1)

    def layer_on(ctx: Ctx) -> MoEExperts:
        layer = MoEExperts(ctx, 2, hidden, inter, torch.float32)
        for (e, part), qt in mats.items():
            param = layer.w2_weight if part == "down" else layer.w13_weight
            param.weight_loader(param, qt, f"{e}.{part}")
        assert layer.assemble_quantized()
        return layer

    whole = layer_on(Ctx())(x, weights, experts)
    total = torch.zeros_like(whole)
    for rank in range(2):
        layer = layer_on(Ctx(tp_rank=rank, tp_size=2))
        want = layer(x, weights, experts)  # the dequantized slice
        install_quantized(layer, plan)
        assert layer.quant_kind == "blob"
        got = layer(x, weights, experts)
        assert ((got - want).norm() / want.norm()).item() < 0.03
        total += want
    torch.testing.assert_close(total, whole, rtol=1e-4, atol=1e-5)
