"""Mixture-of-experts layers (kvray/models/moe.py): the grouped expert computation equals a
plain per-token, per-expert loop on odd shapes (top-k 1 / 2 / 8, experts that receive no
token, every expert hit); the ranks' partial sums under plain TP and under expert
parallelism add up to the whole; transformers v5's fused expert tensors load like the
per-expert ones; bad layouts are errors naming the setting. Greedy parity with transformers
for Mixtral / Qwen2-MoE / Qwen3-MoE runs in the parity suites (their tiny models are in
tests/helpers/tiny_models.py's ARCHS), TP / EP / PP in tests/test_distributed.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvray.models.moe import MoEExperts
from kvray.parallel import ParallelContext
from tests.helpers.moe_routing import random_routing
from tests.helpers.tiny_models import load_hf, make_tiny_model

HIDDEN, INTER = 24, 20


def _expert_weights(num_experts: int, seed: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [{"gate": torch.randn(INTER, HIDDEN, generator=g) * 0.3,
             "up": torch.randn(INTER, HIDDEN, generator=g) * 0.3,
             "down": torch.randn(HIDDEN, INTER, generator=g) * 0.3}
            for _ in range(num_experts)]


def _experts(weights: list[dict[str, torch.Tensor]], ctx: ParallelContext) -> MoEExperts:
    experts = MoEExperts(ctx, len(weights), HIDDEN, INTER, torch.float32)
    for e, w in enumerate(weights):
        for part, t in w.items():
            param = experts.w2_weight if part == "down" else experts.w13_weight
            param.weight_loader(param, t, f"{e}.{part}")
    return experts


def _reference(x, weights, routing, choice):
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(choice.shape[1]):
            w = weights[int(choice[t, j])]
            h = F.silu(x[t] @ w["gate"].T) * (x[t] @ w["up"].T)
            out[t] += routing[t, j] * (h @ w["down"].T)
    return out


@pytest.mark.unit
@pytest.mark.parametrize("tokens,top_k,allowed", [
    (1, 1, list(range(8))), (1, 2, list(range(8))), (5, 2, [1, 6]),  # 6 experts get nothing
    (37, 2, list(range(8))), (37, 8, list(range(8))),  # every token to every expert
    (3, 1, [7]), (64, 3, [0, 2, 3, 5])])
def test_grouped_experts_equal_a_per_token_loop(tokens, top_k, allowed):
    weights = _expert_weights(8, seed=tokens + top_k)
    experts = _experts(weights, ParallelContext())
    x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(top_k))
    routing, choice = random_routing(tokens, 8, top_k, allowed, seed=tokens)
    got = experts(x, routing, choice)
    torch.testing.assert_close(got, _reference(x, weights, routing, choice), rtol=1e-5,
                               atol=1e-5)


@pytest.mark.unit
@pytest.mark.parametrize("layout", ["sliced", "contiguous", "placed"])
def test_ranks_partial_sums_add_up_to_the_whole(layout):
    """Each rank loads only its share from the same per-expert tensors (a slice of every
    expert, or whole experts: contiguous ranges, or a placement that interleaves them), and
    the TP all-reduce's sum of the partials is the layer."""
    weights = _expert_weights(6, seed=3)
    x = torch.randn(29, HIDDEN, generator=torch.Generator().manual_seed(4))
    routing, choice = random_routing(29, 6, 2, list(range(6)), seed=5)
    whole = _experts(weights, ParallelContext())(x, routing, choice)
    placement = {0: ((0, 2, 5), (1, 3, 4))} if layout == "placed" else None
    held = placement[0] if placement else ((0, 1, 2), (3, 4, 5))
    parts = []
    for rank in range(2):
        ctx = ParallelContext(tp_rank=rank, tp_size=2, expert_parallel=layout != "sliced",
                              expert_placement=placement)
        experts = _experts(weights, ctx)
        if layout == "sliced":
            assert experts.w13_weight.shape == (6, INTER, HIDDEN)
        else:
            assert experts.held == list(held[rank])
            for i, e in enumerate(held[rank]):  # row i holds expert held[i], whole
                assert torch.equal(experts.w2_weight[i], weights[e]["down"])
        parts.append(experts(x, routing, choice))
    torch.testing.assert_close(parts[0] + parts[1], whole, rtol=1e-5, atol=1e-5)


@pytest.mark.unit
def test_layouts_that_cannot_split_name_the_setting():
    with pytest.raises(ValueError, match="enable_expert_parallel: 6 experts do not split "
                                         "evenly over tensor_parallel_size = 4"):
        MoEExperts(ParallelContext(tp_rank=0, tp_size=4, expert_parallel=True), 6, HIDDEN,
                   INTER, torch.float32)
    with pytest.raises(ValueError, match="intermediate size 20 does not split evenly over "
                                         "tensor_parallel_size = 3"):
        MoEExperts(ParallelContext(tp_rank=0, tp_size=3), 6, HIDDEN, INTER, torch.float32)


@pytest.mark.parity
@pytest.mark.parametrize("arch", ["mixtral_moe", "qwen2_moe_shared"])
@torch.inference_mode()
def test_fused_expert_tensors_load_like_per_expert_ones(arch, tmp_path):
    """transformers v5 keeps a layer's experts as ``experts.gate_up_proj`` [E, 2I, H] and
    ``experts.down_proj`` [E, H, I] and can save them so: the same model either way."""
    import transformers

    from kvray.kernels.attention import AttentionMetadata
    from kvray.models.loader import load_model

    legacy = make_tiny_model(arch, tmp_path / "legacy")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(legacy), dtype=torch.float32)
    fused = tmp_path / "fused"
    hf.save_pretrained(fused, save_original_format=False)
    from safetensors import safe_open

    with safe_open(str(fused / "model.safetensors"), framework="pt") as f:
        assert any(k.endswith("experts.gate_up_proj") for k in f.keys())  # noqa: SIM118
    seq = torch.randint(3, 300, (19,), generator=torch.Generator().manual_seed(0))
    meta = AttentionMetadata.for_full_sequences([19])
    logits = []
    for path in (legacy, fused):
        model, _ = load_model(path, "float32")
        logits.append(model.compute_logits(model(seq, meta)))
    assert torch.equal(logits[0], logits[1])


@pytest.mark.parity
def test_missing_expert_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    from kvray.models.loader import WeightLoadError, load_model

    path = make_tiny_model("qwen3_moe", tmp_path / "m")
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["model.layers.1.mlp.experts.5.up_proj.weight"]
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(WeightLoadError, match=r"missing from checkpoint: "
                                              r"model\.layers\.1\.mlp\.experts\.5\.up_proj"):
        load_model(path, "float32")


@pytest.mark.engine
@pytest.mark.parametrize("arch", ["qwen2_moe_shared", "mixtral_moe"])
def test_moe_models_decode_a_stage_in_one_fused_call_in_an_engine(tmp_path, arch):
    """An engine on a MoE model (Qwen2-MoE's shared expert and a dense mlp_only layer
    among them) runs its decode steps as one ``decode_layers_moe`` call per stage, and
    decodes as transformers does."""
    from kvray import LLM, SamplingParams
    from kvray.models.llama import LlamaMLP
    from kvray.models.moe import SparseMoeBlock
    from tests.helpers.tiny_models import transformers_greedy

    path = make_tiny_model(arch, tmp_path / "m")
    prompts = [{"prompt_token_ids": [5, 9, 77, 3, 41]}, {"prompt_token_ids": [8] * 13}]
    llm = LLM(str(path), dtype="float32", block_size=4)
    try:
        model = llm.llm_engine.executor.worker.runner.model.model
        if arch == "qwen2_moe_shared":
            kinds = [type(layer.mlp) for layer in model.layers]
            assert kinds == [SparseMoeBlock, LlamaMLP, SparseMoeBlock]
        assert all(layer.fused_decode is not None for layer in model.layers)
        stack = model.fused_decode_stack
        assert stack is not None and "moe" in stack.__name__
        calls = []

        def counted(*args):
            calls.append(args[0].shape[0])
            return stack(*args)

        model.fused_decode_stack = counted
        params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        llm.shutdown()
    assert len(calls) >= 9, "every pure decode step is one call"
    assert got == transformers_greedy(path, prompts, 10)


@pytest.mark.unit
def test_expert_token_counts_count_only_the_real_rows_inside_counting():
    from kvray.models.expert_stats import ExpertTokenCounts

    counter = ExpertTokenCounts([0, 3], num_experts=4, device="cpu")
    experts = torch.tensor([[0, 1], [1, 2], [3, 1]])  # three rows, top-2
    counts = torch.bincount(experts.reshape(-1), minlength=4)
    counter.add(3, experts, counts)  # outside counting(): a profile run, say
    assert counter.take() == {0: [0, 0, 0, 0], 3: [0, 0, 0, 0]}
    with counter.counting(3):
        counter.add(0, experts, counts)
        counter.add(3, experts, counts)
    with counter.counting(2):  # the third row pads the batch
        counter.add(3, experts, counts)
    assert counter.num_rows == 0
    assert counter.take() == {0: [1, 3, 1, 1], 3: [2, 5, 2, 1]}
    assert counter.take() == {0: [0, 0, 0, 0], 3: [0, 0, 0, 0]}  # taken: counts restart


def _hf_expert_counts(path, sequences: list[list[int]]) -> dict[int, list[int]]:
    """Tokens per expert of each MoE layer when transformers runs ``sequences``: its own
    router logits, top-k."""
    import transformers

    from kvray.models.spec import ModelSpec

    spec = ModelSpec.from_hf_config(transformers.AutoConfig.from_pretrained(str(path)))
    hf = load_hf(path)
    layers = [i for i in range(spec.num_layers) if spec.is_moe_layer(i)]
    counts = {layer: [0] * spec.num_experts for layer in layers}
    with torch.inference_mode():
        for seq in sequences:
            logits = hf(torch.tensor([seq]), output_router_logits=True).router_logits
            for layer, lg in zip(layers, logits, strict=True):
                for e in lg.topk(spec.num_experts_per_tok, dim=-1).indices.reshape(-1):
                    counts[layer][int(e)] += 1
    return counts


@pytest.mark.engine
@pytest.mark.parametrize("padded", [False, True])
def test_expert_token_counts_match_the_routing(monkeypatch, tmp_path, padded):
    """An engine counts each token it computes once per MoE layer, under the experts its
    router chose: transformers' routing of the same tokens (prompt and every output token
    but the last) gives the same counts; the dense layer (Qwen2-MoE's mlp_only_layers) has
    none; the start-up probes of preemption_mode auto count nothing, and neither do a padded
    decode batch's pad rows (decode graphs forced on: on CPU they run the padded batch
    eagerly)."""
    from kvray import LLM, SamplingParams
    from kvray.actors.model_runner import ModelRunner

    path = make_tiny_model("qwen2_moe_shared", tmp_path / "m")
    if padded:
        monkeypatch.setattr(ModelRunner, "_decode_graphs_wanted", lambda self: True)
    prompts = [[5, 9, 77, 3, 41], [8] * 13, list(range(30, 50))]
    max_tokens = [7, 4, 9]  # decode batches of 3, 2, 1 rows: padded to 4, 2, 1
    llm = LLM(str(path), dtype="float32", block_size=4, enable_prefix_caching=False,
              preemption_mode="auto", max_num_seqs=8, cuda_graph_sizes=[1, 2, 4])
    try:
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
                  for n in max_tokens]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                            use_tqdm=False)
        runner = llm.llm_engine.executor.worker.runner
        assert (runner.graphs is not None and runner.graphs.padded_rows > 0) is padded
        load = llm.expert_load()
        assert llm.llm_engine.published_stats.moe_expert_tokens == load
    finally:
        llm.shutdown()
    seqs = [p + o.outputs[0].token_ids[:-1] for p, o in zip(prompts, outs, strict=True)]
    assert sorted(load) == [0, 2]
    assert all(sum(counts) == 2 * sum(map(len, seqs)) for counts in load.values())
    assert load == _hf_expert_counts(path, seqs)


@pytest.mark.unit
def test_expert_token_counts_are_exported_by_layer_and_expert_for_moe_models_only():
    from kvray.serve.metrics import ServerMetrics

    metrics = ServerMetrics("m")
    metrics.set_replica_stats([("r0", {"moe_expert_tokens": {0: [5, 0, 7], 2: [1, 2, 3]}}),
                               ("r1", {"num_running": 1})])  # a dense model's replica
    text = metrics.render().decode()
    assert 'kvray:moe_expert_tokens_total{expert="2",layer="0",model_name="m",' \
           'replica="r0"} 7.0' in text
    assert 'kvray:moe_expert_tokens_total{expert="1",layer="0",model_name="m",' \
           'replica="r0"} 0.0' in text
    assert text.count("kvray:moe_expert_tokens_total{") == 6
    assert 'replica="r1"' in text and 'expert="0",layer="0",model_name="m",replica="r1"' \
        not in text
    metrics.set_replica_stats([("r1", {"num_running": 1})])  # r0 left: its series go too
    assert "kvray:moe_expert_tokens_total{" not in metrics.render().decode()


@pytest.mark.engine
def test_a_load_file_for_another_model_stops_the_start_naming_expert_placement(tmp_path):
    import json

    from kvray import LLM
    from kvray.config import ConfigError

    path = make_tiny_model("qwen3_moe", tmp_path / "m")  # 8 experts in each of 3 layers
    load = tmp_path / "load.json"
    load.write_text(json.dumps({str(layer): [1] * 6 for layer in range(3)}))
    with pytest.raises(ConfigError, match="expert_placement: layer 0 has counts for 6 "
                                          "experts, but this model has 8 per layer"):
        LLM(str(path), dtype="float32", enable_expert_parallel=True,
            expert_placement=str(load))


def _int8_parts(num_experts: int, hidden: int, inter: int, seed: int) -> list[dict]:
    """Per expert gate / up / down as int8 QuantTensors (a quantized checkpoint's pieces)."""
    from kvray.quant.online import quantize_int8

    g = torch.Generator().manual_seed(seed)
    shapes = {"gate": (inter, hidden), "up": (inter, hidden), "down": (hidden, inter)}
    return [{part: quantize_int8(torch.randn(*shape, generator=g) * 0.3)
             for part, shape in shapes.items()} for _ in range(num_experts)]


@pytest.mark.unit
@pytest.mark.parametrize("layout", ["sliced", "expert_parallel"])
def test_quantized_expert_tensors_are_held_quantized_per_rank(layout):
    """A quantized checkpoint's expert tensors stay quantized: each rank keeps its slice
    (gate / up rows, down columns) or its whole experts, stacked per expert once loaded,
    and the ranks' partial sums add up to the layer on the dequantized weights."""
    hidden, inter, n = 64, 128, 4
    parts = _int8_parts(n, hidden, inter, seed=1)
    dense = [{p: q.dequantize() for p, q in w.items()} for w in parts]
    x = torch.randn(9, hidden, generator=torch.Generator().manual_seed(2))
    routing, choice = random_routing(9, n, 2, [0, 1, 3], seed=3)  # expert 2 gets nothing
    whole = MoEExperts(ParallelContext(), n, hidden, inter, torch.float32)
    for e, w in enumerate(dense):
        for part, t in w.items():
            param = whole.w2_weight if part == "down" else whole.w13_weight
            param.weight_loader(param, t, f"{e}.{part}")
    want = whole(x, routing, choice)
    partials = []
    for rank in range(2):
        ctx = ParallelContext(tp_rank=rank, tp_size=2,
                              expert_parallel=layout == "expert_parallel")
        experts = MoEExperts(ctx, n, hidden, inter, torch.float32)
        for e, w in enumerate(parts):
            for part, q in w.items():
                param = experts.w2_weight if part == "down" else experts.w13_weight
                param.weight_loader(param, q, f"{e}.{part}")
        assert experts.assemble_quantized() and not experts.w13_weight.numel()
        for i, e in enumerate(experts.held):
            rows = slice(experts.inter_start, experts.inter_start + experts.inter)
            w13, w2 = (q.dequantize() for q in experts.quant[i])
            assert torch.equal(w13, torch.cat([dense[e]["gate"][rows], dense[e]["up"][rows]]))
            assert torch.equal(w2, dense[e]["down"][:, rows])
        partials.append(experts(x, routing, choice))  # the dequantized reference path
    torch.testing.assert_close(partials[0] + partials[1], want, rtol=1e-5, atol=1e-5)


@pytest.mark.unit
def test_experts_partly_quantized_are_dequantized_and_a_bad_split_names_the_key():
    hidden, inter = 64, 128
    parts = _int8_parts(2, hidden, inter, seed=4)
    experts = MoEExperts(ParallelContext(), 2, hidden, inter, torch.float32)
    for part, q in parts[0].items():  # expert 0 quantized, expert 1 dense
        param = experts.w2_weight if part == "down" else experts.w13_weight
        param.weight_loader(param, q, f"0.{part}")
        param.weight_loader(param, parts[1][part].dequantize(), f"1.{part}")
    assert not experts.assemble_quantized() and experts.quant is None
    for e in range(2):
        assert torch.equal(experts.w2_weight[e], parts[e]["down"].dequantize())
        assert torch.equal(experts.w13_weight[e, :inter], parts[e]["gate"].dequantize())
    odd = _int8_parts(1, hidden, 80, seed=5)[0]  # 40 columns per rank: not whole blocks
    tp = MoEExperts(ParallelContext(tp_rank=1, tp_size=2), 1, hidden, 80, torch.float32)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        tp.w2_weight.weight_loader(tp.w2_weight, odd["down"], "0.down")


@pytest.mark.engine
def test_an_int8_moe_engine_holds_its_experts_quantized_and_decodes(tmp_path):
    """``quantization: int8`` on a MoE model: the start-up report counts every expert's two
    matrices as held quantized (none dequantized), the layers read blobs, and a batch with a
    prompt twice decodes it to the same greedy tokens in both rows (each row's experts and
    int8 linears computed as if alone)."""
    from kvray import LLM, SamplingParams
    from kvray.models.moe import MoEExperts

    path = make_tiny_model("qwen3_moe", tmp_path / "m")
    twice = {"prompt_token_ids": [5, 9, 77, 3, 41]}
    prompts = [twice, {"prompt_token_ids": [8] * 13}, twice,
               {"prompt_token_ids": list(range(20, 51))}]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    llm = LLM(str(path), dtype="float32", block_size=4, quantization="int8")
    try:
        report = llm.llm_engine.startup["ranks"][0]["quantized"]
        experts = [m for m in llm.llm_engine.executor.worker.runner.model.modules()
                   if isinstance(m, MoEExperts)]
        assert experts and all(m.quant_kind == "blob" for m in experts)
        assert report["dequantized"] == 0
        assert report["tensors"] >= sum(2 * m.num_local for m in experts)
        out = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        llm.shutdown()
    assert out[0] == out[2] and all(len(t) == 12 for t in out)
