"""The Ray runtime: TP x PP worker actors on a local loopback cluster give the same greedy
tokens as transformers (fp32) and one in-process worker; KV swap to the object store; a
dead worker fails fast."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # read at import: loopback listeners

import psutil  # noqa: E402
import pytest  # noqa: E402
import ray  # noqa: E402
import torch  # noqa: E402

from kvray import LLM, LoRARequest, SamplingParams  # noqa: E402
from kvray.engine.llm_engine import EngineDeadError  # noqa: E402
from tests.helpers.lora import make_lora_adapter, peft_greedy  # noqa: E402
from tests.helpers.tiny_models import VOCAB_SIZE, make_tiny_model, transformers_greedy  # noqa: E402

pytestmark = pytest.mark.cluster

PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PARITY_TOKENS = 24  # long enough for a wrong cached or pipelined position to show
COMMON = dict(dtype="float32", block_size=4, max_num_batched_tokens=16,
              enable_prefix_caching=True, enable_chunked_prefill=True, max_num_seqs=8)


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=8, _node_ip_address="127.0.0.1", include_dashboard=False,
             log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist_models")
    return {
        "gqa4": make_tiny_model("llama_gqa", root / "gqa4", num_attention_heads=8,
                                num_key_value_heads=4, hidden_size=64),
        "kv1": make_tiny_model("llama3_rope_tied", root / "kv1"),  # 1 KV head < TP size
        "qwen2_moe": make_tiny_model("qwen2_moe_shared", root / "qwen2_moe"),
        "qwen3_moe": make_tiny_model("qwen3_moe", root / "qwen3_moe"),
        "gemma2": make_tiny_model("gemma2_softcap", root / "gemma2"),
        "gemma3": make_tiny_model("gemma3_text", root / "gemma3"),
        "mixtral": make_tiny_model("mixtral_moe", root / "mixtral"),
        "phi3": make_tiny_model("phi3_longrope", root / "phi3"),
    }


def _prompts() -> list[dict]:
    g = torch.Generator().manual_seed(5)
    lens = [3, 20, 9, 33, 1, 14]
    prompts = [torch.randint(3, VOCAB_SIZE, (n,), generator=g).tolist() for n in lens]
    prompts.append(prompts[3][:24] + [7, 8])  # shares a prefix with prompt 3
    return [{"prompt_token_ids": p} for p in prompts]


def _tokens(llm: LLM, max_tokens: int = PARITY_TOKENS) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(_prompts(), params, use_tqdm=False)]


@pytest.fixture(scope="module")
def reference(models):
    """Transformers' greedy tokens, which one in-process worker also gives."""
    out = {}
    for name, path in models.items():
        out[name] = transformers_greedy(path, _prompts(), PARITY_TOKENS)
        llm = LLM(str(path), **COMMON)
        one_worker = _tokens(llm)
        llm.shutdown()
        assert one_worker == out[name], name
    return out


LOOPBACK = ("127.0.0.1", "::1", "::ffff:127.0.0.1")


def _non_loopback_listeners() -> list:
    """Listening sockets of this process and everything it started (Ray, workers)."""
    ours = {p.pid for p in psutil.Process().children(recursive=True)} | {os.getpid()}
    found = []
    for c in psutil.net_connections(kind="inet"):
        if c.status == psutil.CONN_LISTEN and c.pid in ours and c.laddr.ip not in LOOPBACK:
            try:  # name the process: the assertion message says who listens
                who = " ".join(psutil.Process(c.pid).cmdline())[:100]
            except psutil.Error:
                who = "?"
            found.append((c.laddr, c.pid, who))
    return found


def test_cluster_and_workers_listen_on_loopback_only(cluster, models):
    llm = LLM(str(models["gqa4"]), tensor_parallel_size=2, pipeline_parallel_size=2, **COMMON)
    try:
        llm.generate(_prompts()[:2], PARAMS, use_tqdm=False)
        assert not _non_loopback_listeners()
    finally:
        llm.shutdown()


@pytest.mark.parametrize("model,tp,pp,ep", [
    ("gqa4", 2, 1, False), ("gqa4", 1, 2, False), ("gqa4", 2, 2, False), ("kv1", 2, 1, False),
    # MoE: every expert sliced over TP, or whole experts per rank (expert parallelism),
    # also across pipeline stages
    ("qwen2_moe", 2, 1, False), ("qwen2_moe", 2, 1, True), ("qwen3_moe", 2, 2, True),
    # the dense families of issue 43: capped scores, sandwich norms, sliding layers and two
    # rope bases split over PP; Phi-3's fused tensors split over TP
    ("gemma2", 2, 2, False), ("gemma3", 2, 2, False), ("phi3", 2, 2, False),
    ("mixtral", 2, 2, False)])
def test_parallel_layouts_match_one_worker(cluster, models, reference, model, tp, pp, ep):
    llm = LLM(str(models[model]), tensor_parallel_size=tp, pipeline_parallel_size=pp,
              enable_expert_parallel=ep, **COMMON)
    try:
        assert _tokens(llm) == reference[model]
        assert llm.llm_engine.stats.prefix_cache_hits > 0
    finally:
        llm.shutdown()
    assert not ray.util.placement_group_table() or all(
        pg["state"] == "REMOVED" for pg in ray.util.placement_group_table().values())


def test_experts_placed_by_measured_load_give_transformers_tokens(cluster, models, tmp_path):
    """Expert parallelism at TP = 2 x PP = 2 with experts placed by a load file that
    interleaves them (layer 0: rank 0 holds experts 0, 3, 4, 7): transformers' greedy
    tokens. Each rank's start-up report holds its stage's placement, whose predicted rank
    imbalance is no worse than the contiguous ranges' (better where they split hot experts
    badly); both stages' expert counters come back by global layer."""
    import json

    from kvray.models.expert_placement import contiguous_experts, plan_placement

    loads = {0: [80, 70, 60, 50, 1, 2, 3, 4], 1: [1, 2, 3, 4, 80, 70, 60, 50],
             2: [9, 1, 9, 1, 9, 1, 9, 1]}
    (tmp_path / "load.json").write_text(json.dumps(loads))
    plan = plan_placement(loads, [0, 1, 2], num_experts=8, num_ranks=2)
    assert all(plan[layer] != contiguous_experts(8, 2) for layer in plan)
    path = models["qwen3_moe"]
    llm = LLM(str(path), tensor_parallel_size=2, pipeline_parallel_size=2,
              enable_expert_parallel=True, expert_placement=str(tmp_path / "load.json"),
              **COMMON)
    try:
        tokens = _tokens(llm)
        ranks = [r["moe"] for r in llm.llm_engine.startup["ranks"]]  # pp * tp + tp_rank
        load = llm.expert_load()
    finally:
        llm.shutdown()
    assert tokens == transformers_greedy(path, _prompts(), PARITY_TOKENS)
    for rank, report in enumerate(ranks):
        layers = [0, 1] if rank < 2 else [2]  # stage 0 holds layers 0-1, stage 1 layer 2
        assert report["placement"] == {layer: [list(r) for r in plan[layer]]
                                       for layer in layers}
        predicted, contiguous = report["predicted_imbalance"], report["contiguous_imbalance"]
        assert all(predicted[layer] <= contiguous[layer] for layer in layers)
    assert ranks[0]["predicted_imbalance"][0] < ranks[0]["contiguous_imbalance"][0]
    assert sorted(load) == [0, 1, 2] and all(len(c) == 8 for c in load.values())
    assert len({sum(c) for c in load.values()}) == 1 and sum(load[0]) > 0


@pytest.mark.parametrize("model,tp,pp", [("kv1", 2, 1), ("gqa4", 1, 2), ("phi3", 2, 2)])
def test_lora_adapters_shard_like_their_layers(cluster, models, tmp_path, model, tp, pp):
    """A batch mixing two adapters and the base model under TP (B split like the column
    layers, A like the row layers; one KV head shared by both ranks), PP (each stage its
    layers' adapters) and both (Phi-3's fused qkv/gate_up adapters): PEFT's tokens."""
    base = models[model]
    fused = model == "phi3"  # Phi-3's own module names
    adapters = {
        "a": make_lora_adapter(base, tmp_path / "a", rank=8, seed=1, targets=[
            "qkv_proj", "o_proj", "gate_up_proj", "down_proj"] if fused else None),
        "b": make_lora_adapter(base, tmp_path / "b", rank=16, seed=2, targets=[
            "qkv_proj", "down_proj"] if fused else ["q_proj", "k_proj", "v_proj", "down_proj"]),
    }
    prompts = _prompts()
    names = [None, "a", "b", "a", "b", None, "b"]
    expected = [peft_greedy(base, adapters[n] if n else None, [p["prompt_token_ids"]], 12)[0]
                for p, n in zip(prompts, names, strict=True)]
    requests = {n: LoRARequest(n, i + 1, str(p)) for i, (n, p) in enumerate(adapters.items())}
    llm = LLM(str(base), tensor_parallel_size=tp, pipeline_parallel_size=pp, enable_lora=True,
              max_loras=2, max_lora_rank=16, **COMMON)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        outs = llm.generate(prompts, params, use_tqdm=False,
                            lora_request=[requests[n] if n else None for n in names])
        assert [o.outputs[0].token_ids for o in outs] == expected
    finally:
        llm.shutdown()


def test_pipelined_steps_overlap_and_give_the_same_tokens(cluster, models, unconstrained):
    """PP=2 keeps two steps in flight over disjoint halves of the batch, also while blocks
    run short (preemption only of requests not in flight) and prefixes are shared; with one
    micro-batch the stages take turns."""
    for micro_batches, overlapped in ((None, True), (1, False)):
        tokens, llm = _long_preemption_run(models, pipeline_parallel_size=2,
                                           pipeline_micro_batches=micro_batches)
        try:
            stats = llm.llm_engine.stats
            assert tokens == unconstrained
            assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
            assert (stats.num_overlapped_steps > 0) is overlapped
        finally:
            llm.shutdown()


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_async_scheduling_over_ray_workers_gives_the_same_tokens(cluster, models,
                                                                 unconstrained, tp, pp):
    """The next step goes to the workers before the current one returns, its placeholders
    filled from the current step's sampled tokens (which Ray hands every rank): the same
    tokens over TP and PP, also while blocks run short (preemption after draining)."""
    tokens, llm = _long_preemption_run(models, tensor_parallel_size=tp,
                                       pipeline_parallel_size=pp, async_scheduling=True)
    try:
        assert tokens == unconstrained
        assert llm.llm_engine.stats.num_preemptions > 0
        assert llm.llm_engine.scheduler.num_placeholders > 0
    finally:
        llm.shutdown()


def _long_preemption_run(models, path: Path | None = None, **kw) -> tuple[list[list[int]],
                                                                           LLM]:
    llm = LLM(str(path or models["gqa4"]), **{"distributed_executor_backend": "ray", **kw},
              num_gpu_blocks_override=24, **{**COMMON, "max_num_batched_tokens": 32})
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outs = llm.generate(_prompts(), params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm


@pytest.fixture(scope="module")
def unconstrained(models):
    """Transformers' greedy tokens, which one roomy in-process worker also gives."""
    want = transformers_greedy(models["gqa4"], _prompts(), 24)
    llm = LLM(str(models["gqa4"]), **{**COMMON, "max_num_batched_tokens": 32})
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    out = [o.outputs[0].token_ids for o in llm.generate(_prompts(), params, use_tqdm=False)]
    llm.shutdown()
    assert out == want
    return want


def test_swap_preemption_gives_the_same_tokens_and_leaves_nothing(cluster, models,
                                                                  unconstrained):
    tokens, llm = _long_preemption_run(models, preemption_mode="swap", swap_space=0.01)
    try:
        stats = llm.llm_engine.stats
        assert tokens == unconstrained
        assert stats.num_swaps_out > 0 and stats.num_swaps_in > 0
        assert llm.llm_engine.executor.swap_objects() == [0]
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def gguf_q4_1(models, tmp_path_factory):
    """The gqa4 model as a Q4_1 GGUF (every matrix in 4-bit blocks with mins, as the
    built-in model ships), which kvray keeps quantized."""
    from tests.helpers.tiny_gguf import write_gguf

    return write_gguf(models["gqa4"], tmp_path_factory.mktemp("gguf") / "gqa4-Q4_1.gguf",
                      quant={"*": "Q4_1"})


def test_a_quantized_gguf_shards_over_tp_and_pp_and_swaps_its_int8_kv(cluster, models,
                                                                      gguf_q4_1):
    """The GGUF's blocks split over TP x PP ranks (each holds its quantized shard, split on
    block boundaries) give one worker's tokens; an int8 KV cache swapped out to the object
    store and back under preemption gives the unconstrained run's tokens."""
    kw = dict(kv_cache_dtype="int8")
    one = LLM(str(gguf_q4_1), **kw, **COMMON)
    try:
        want = _tokens(one)
        held = one.llm_engine.startup["ranks"][0]["quantized"]
        long_params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
        roomy = [o.outputs[0].token_ids
                 for o in one.generate(_prompts(), long_params, use_tqdm=False)]
    finally:
        one.shutdown()
    assert held["tensors"] == 3 * 4 + 2 and held["dequantized"] == 0  # + embedding, LM head
    assert sum(held["kinds"].values()) == held["tensors"], held

    llm = LLM(str(gguf_q4_1), tensor_parallel_size=2, pipeline_parallel_size=2, **kw,
              **COMMON)
    try:
        assert _tokens(llm) == want
        ranks = [r["quantized"] for r in llm.llm_engine.startup["ranks"]]
    finally:
        llm.shutdown()
    # 4 ranks, each with its stage's layers (and the embedding / LM head on the first /
    # last stage), all quantized: together about the one worker's bytes
    assert all(r["tensors"] > 0 and r["dequantized"] == 0 for r in ranks), ranks
    assert 0.9 * held["bytes"] <= sum(r["bytes"] for r in ranks) <= 1.1 * held["bytes"]

    tokens, llm = _long_preemption_run(models, gguf_q4_1, tensor_parallel_size=2,
                                       preemption_mode="swap", swap_space=0.01, **kw)
    try:
        stats = llm.llm_engine.stats
        assert tokens == roomy
        assert stats.num_swaps_out > 0 and stats.num_swaps_in > 0
    finally:
        llm.shutdown()


def test_an_act_order_gptq_checkpoint_splits_its_input_columns_over_tp(cluster, models,
                                                                       tmp_path):
    """GPTQ with act order (desc_act): a row-parallel layer's columns (o_proj, down_proj)
    land on each TP rank in runs of the stored, group-sorted order, padded to whole
    blocks; 2 ranks, each holding every linear's shard quantized, give one worker's
    log-probs. Not its exact tokens: the decode kernels quantize the activations per
    block of 32 columns, and a shard's blocks hold other columns than the whole matrix's
    (prompt 3's first token is a near-tie, 0.008 apart, that this flips)."""
    from tests.helpers.quant_checkpoints import write_quantized_checkpoint

    quant_dir, _ = write_quantized_checkpoint(models["gqa4"], tmp_path, "gptq", bits=4,
                                              group=32, sym=False, desc_act=True)
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=3, prompt_logprobs=0)

    def run(llm: LLM) -> tuple[list, list]:
        outs = llm.generate(_prompts(), params, use_tqdm=False)
        prompt = [lp.logprob for o in outs for pos in o.prompt_logprobs[1:]
                  for lp in pos.values()]
        return prompt, [o.outputs[0].logprobs[0] for o in outs]

    one = LLM(str(quant_dir), **COMMON)
    try:
        want_prompt, want_first = run(one)
        held = one.llm_engine.startup["ranks"][0]["quantized"]
    finally:
        one.shutdown()
    llm = LLM(str(quant_dir), tensor_parallel_size=2, **COMMON)
    try:
        got_prompt, got_first = run(llm)
        ranks = [r["quantized"] for r in llm.llm_engine.startup["ranks"]]
    finally:
        llm.shutdown()
    diff = torch.tensor(got_prompt) - torch.tensor(want_prompt)
    assert diff.abs().max() < 0.05 and diff.abs().mean() < 0.01, diff
    for got, want in zip(got_first, want_first, strict=True):
        best = max(want.values(), key=lambda lp: lp.logprob)
        pick = max(got, key=lambda t: got[t].logprob)  # within a near-tie of one worker's
        assert pick in want and want[pick].logprob > best.logprob - 0.05, (got, want)
    assert held["tensors"] > 0 and held["dequantized"] == 0, held
    assert all(r["tensors"] == held["tensors"] and r["dequantized"] == 0 for r in ranks), ranks


def test_full_swap_pool_falls_back_to_recompute(cluster, models, unconstrained):
    tokens, llm = _long_preemption_run(models, preemption_mode="swap", swap_space=1e-9)
    try:
        stats = llm.llm_engine.stats
        assert tokens == unconstrained
        assert stats.num_preemptions > 0 and stats.num_swaps_out == 0
    finally:
        llm.shutdown()


def test_a_second_engine_fetches_the_blocks_the_first_one_evicted(cluster, models,
                                                                   monkeypatch):
    """Two TP=2 engines (two replicas, on Ray workers that own the copies) share one KV
    tier index: blocks engine a computed and evicted are fetched by engine b (remote
    hits), with greedy tokens equal to a roomy engine's; once engine a is gone (its workers
    owned the copies) b recomputes those blocks, with the same tokens."""
    from kvray.engine import llm_engine
    from kvray.serve.kv_tier import RemoteKVTier

    systems = [[3 + (7 * g + 11 * j) % (VOCAB_SIZE - 3) for j in range(29)] for g in range(4)]
    prompts = [{"prompt_token_ids": systems[i % 4] + [5 + i]} for i in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    small = dict(COMMON, tensor_parallel_size=2, num_gpu_blocks_override=24,
                 kv_offload_bytes=1 << 26)
    roomy = LLM(str(models["gqa4"]), **COMMON)
    want = [o.outputs[0].token_ids for o in roomy.generate(prompts, params, use_tqdm=False)]
    roomy.shutdown()

    def engine(owner: str) -> LLM:
        monkeypatch.setattr(llm_engine, "LocalKVTier", lambda capacity: RemoteKVTier(
            "test-kv-tier", capacity, owner))
        return LLM(str(models["gqa4"]), **small)

    a = engine("a")
    try:
        for _ in range(2):  # the second pass evicts what the first computed, and so on
            assert [o.outputs[0].token_ids
                    for o in a.generate(prompts, params, use_tqdm=False)] == want
        assert a.llm_engine.scheduler.tier.stats.offloaded_blocks >= 7 * 4
        b = engine("b")
        try:
            got = [o.outputs[0].token_ids for o in b.generate(prompts[:4], params,
                                                              use_tqdm=False)]
            assert got == want[:4]
            tier = b.llm_engine.scheduler.tier.stats
            assert tier.hit_tokens - tier.local_hit_tokens >= 4 * 28  # a's blocks
            # replica a goes, and its workers' copies with them: b recomputes those blocks
            workers = list(a.llm_engine.executor.workers)
            a.shutdown()
            _wait_until_dead(workers)  # ray.kill returns before the owner process exits
            _wait_until_lost("test-kv-tier", "a")  # and the store frees its objects later
            got = [o.outputs[0].token_ids for o in b.generate(prompts[4:], params,
                                                              use_tqdm=False)]
            assert got == want[4:]
            assert b.llm_engine.scheduler.tier.stats.fetch_failures > 0
        finally:
            b.shutdown()
    finally:
        a.shutdown()
        ray.kill(ray.get_actor("test-kv-tier", namespace="kvray"))


def _wait_until_dead(actors: list, timeout_s: float = 60) -> None:
    """Until every actor's process is gone (and the objects it owned with it)."""
    deadline = time.monotonic() + timeout_s
    for actor in actors:
        while True:
            try:
                ray.get(actor.node_address.remote(), timeout=5)
            except ray.exceptions.RayActorError:
                break
            except ray.exceptions.GetTimeoutError:
                pass
            assert time.monotonic() < deadline, "a killed worker stayed alive"
            time.sleep(0.2)


def _wait_until_lost(tier_name: str, owner: str, timeout_s: float = 60) -> None:
    """Until the tier copies ``owner`` made can no longer be read (Ray frees a dead
    owner's objects some time after its process exits)."""
    index = ray.get_actor(tier_name, namespace="kvray")
    blocks = ray.get(index.lookup.remote(ray.get(index.keys.remote())))
    handles = [h for b in blocks.values() if b.owner == owner for h in b.handles]
    assert handles, f"no tier copies of {owner!r} to lose"
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            ray.get(handles[0], timeout=5)
        except (ray.exceptions.ObjectLostError, ray.exceptions.OwnerDiedError):
            return
        except ray.exceptions.GetTimeoutError:
            pass
        assert time.monotonic() < deadline, f"{owner!r}'s copies outlived their owner"
        time.sleep(0.2)


def test_a_node_without_the_model_files_takes_them_from_the_object_store(cluster, tmp_path):
    """share_weights: an engine that has the files puts them in the object store; once
    they are gone from this "node", a TP=2 engine's workers (and its tokenizer) take them
    from there into the local cache, with the same greedy tokens."""
    import shutil

    from kvray.actors import weights_store

    model = make_tiny_model("llama_gqa", tmp_path / "shared-model")
    prompts = [{"prompt_token_ids": [5 + i, 9, 13, 21]} for i in range(3)]
    llm = LLM(str(model), share_weights=True, **COMMON)
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS, use_tqdm=False)]
    llm.shutdown()
    copy = Path.home() / ".cache" / "kvray" / "object-store-weights" / \
        weights_store._key(str(model))
    hidden = model.rename(tmp_path / "elsewhere")  # this node no longer has the files
    try:
        llm = LLM(str(model), share_weights=True, tensor_parallel_size=2, **COMMON)
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS, use_tqdm=False)]
        llm.shutdown()
        assert got == want
        assert (copy / ".complete").exists() and (copy / model.name / "config.json").exists()
    finally:
        hidden.rename(model)
        shutil.rmtree(copy, ignore_errors=True)
        ray.kill(ray.get_actor(f"kvray-weights-{weights_store._key(str(model))}",
                               namespace="kvray"))


@ray.remote(num_cpus=0)
def _load_cpu_kernels() -> tuple[bool, list[str]]:
    """In a fresh worker process: load kvray's CPU kernels, run one, list the build folder."""
    import torch

    from kvray.kernels import cpu_ops

    x = torch.randn(4, 300)
    ok = cpu_ops.load_ops() is not None and \
        torch.equal(cpu_ops.argmax_rows(x), x.argmax(-1))
    return ok, sorted(p.name for p in cpu_ops.build_directory().iterdir())


def test_a_node_without_the_kernel_build_takes_the_clusters_binary(cluster, tmp_path):
    """A process with this machine's build shares it; a "node" whose extension cache is
    empty (its own TORCH_EXTENSIONS_DIR) then takes that binary instead of compiling."""
    from torch.utils.cpp_extension import get_default_build_root

    def on(root: Path) -> Any:
        return _load_cpu_kernels.options(
            runtime_env={"env_vars": {"TORCH_EXTENSIONS_DIR": str(root)}}).remote()

    ok, files = ray.get(on(Path(get_default_build_root())), timeout=900)
    assert ok and any(f.endswith(".o") for f in files)  # built here (now or before)
    ok, files = ray.get(on(tmp_path / "empty-node"), timeout=300)
    assert ok, files
    assert not any(f.endswith(".o") or f == "build.ninja" for f in files), files  # no compile
    assert any(f.endswith(".so") for f in files)


def test_dead_worker_fails_requests_fast_and_engine_recovers(cluster, models):
    llm = LLM(str(models["gqa4"]), tensor_parallel_size=2, **COMMON)
    engine = llm.llm_engine
    try:
        engine.add_request("a", _prompts()[1], SamplingParams(max_tokens=50, ignore_eos=True))
        engine.step()
        ray.kill(engine.executor.workers[1])
        start = time.monotonic()
        with pytest.raises(EngineDeadError, match="worker actor died"):
            for _ in range(100):
                engine.step()
        assert time.monotonic() - start < 30
        assert not engine.has_unfinished_requests()
        out = llm.generate(_prompts()[:2], PARAMS, use_tqdm=False)  # rebuilt executor
        assert all(len(o.outputs[0].token_ids) == 8 for o in out)
    finally:
        llm.shutdown()


def test_unplaceable_layout_fails_with_the_missing_resources(cluster, models, monkeypatch):
    from kvray.actors import ray_executor

    monkeypatch.setattr(ray_executor, "PLACEMENT_TIMEOUT_S", 2.0)
    with pytest.raises(ray_executor.PlacementError, match="cannot place 16 workers"):
        LLM(str(models["gqa4"]), tensor_parallel_size=8, pipeline_parallel_size=2, **COMMON)
