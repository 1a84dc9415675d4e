"""Mixture-of-experts models: kvray vs transformers, and expert parallelism vs plain TP.

Two random-weight models sized for a small machine, saved with ``save_pretrained``:

- Mixtral-shaped: 8 experts, top-2, every layer MoE;
- Qwen3-MoE-shaped: 32 narrow experts, top-4 renormalised, q/k norms.

For each: output tokens/s of kvray (``LLM.generate``, greedy, ``ignore_eos``) and of
transformers' ``generate`` (fp32, its default experts implementation, a left-padded batch)
at batch 1 and batch 32, and their ratio; kvray's batch-1 decode step against the read floor
of the weights that step actually touches (attention, router, norms, the k chosen experts
per layer, one embedding row and the LM head) at the read bandwidth measured in the same
run: the best of its 256 MiB probes (the demanding floor: on a CPU with a large L3 part of
that buffer, like part of the models' weights, is read from the cache) and the 1 GiB probe
``decode_step.py`` uses (past the caches). With ``--tp``: the Mixtral shape at TP = 2 on
a local Ray cluster with every expert sliced over the ranks vs whole experts per rank
(``enable_expert_parallel``): step time and the bytes each rank reads and all-reduces per
decode step. With ``--int8``: kvray with
``quantization: int8`` (every linear and every expert held as int8, read by the CPU int8
kernels) against its fp32 run: batch-1 step and batch-N output tokens/s.

With ``--layers N``: both shapes N layers deep instead of 4.

    python benchmarks/moe.py [--tokens 48] [--batch 32] [--tp] [--int8] [--layers N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import torch  # noqa: E402
import transformers  # noqa: E402

from benchmarks.common import read_bandwidth  # noqa: E402
from kvray.hardware import describe  # noqa: E402

VOCAB = 8192
SHAPES = {
    "mixtral": ("MixtralConfig", dict(
        hidden_size=512, intermediate_size=1024, num_local_experts=8, num_experts_per_tok=2,
        num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, sliding_window=None)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(
        hidden_size=512, moe_intermediate_size=256, intermediate_size=1024, num_experts=32,
        num_experts_per_tok=4, norm_topk_prob=True, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=2, head_dim=64)),
}


def make_model(name: str, root: Path, layers: int | None = None) -> Path:
    cls, kwargs = SHAPES[name]
    if layers is not None:
        kwargs = {**kwargs, "num_hidden_layers": layers}
    config = getattr(transformers, cls)(vocab_size=VOCAB, max_position_embeddings=2048,
                                        tie_word_embeddings=False, **kwargs)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # routers far from uniform, as trained ones are
        for n, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0, 0.3 if n.endswith("gate.weight") else 0.05)
    path = root / name
    model.save_pretrained(path)
    # the built-in model's tokenizer (49,152 ids: every id these models emit is one)
    from kvray.models.default_model import default_model_dir

    transformers.AutoTokenizer.from_pretrained(str(default_model_dir())).save_pretrained(path)
    return path


def cache_probe() -> float:
    """Read bandwidth (bytes/s) of a buffer about this benchmark's models' size: the best of
    15 sums over 256 MiB (a single probe on a shared host read as little as half of it).
    Where the L3 is that large, part of it comes from the cache, as part of the models'
    weights do."""
    big = torch.ones(64 << 20, dtype=torch.float32)
    best = float("inf")
    for _ in range(15):
        t = time.perf_counter()
        big.sum()
        best = min(best, time.perf_counter() - t)
    return big.numel() * 4 / best


def touched_bytes(config, elem: int = 4) -> int:
    """Weights one decode token reads: everything but the experts it was not routed to."""
    h, layers = config.hidden_size, config.num_hidden_layers
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    hd = getattr(config, "head_dim", None) or h // heads
    experts = getattr(config, "num_local_experts", None) or config.num_experts
    inter = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    attn = h * hd * (heads + 2 * kv) + heads * hd * h
    per_layer = attn + h * experts + config.num_experts_per_tok * 3 * h * inter + 2 * h
    return elem * (layers * per_layer + h + VOCAB * h + h)  # one embedding row, head, norm


def prompts(batch: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(batch)
    return [torch.randint(10, VOCAB, (32,), generator=g).tolist() for _ in range(batch)]


def run_kvray(path: Path, batch: int, tokens: int, **kwargs) -> float:
    from kvray import LLM, SamplingParams

    llm = LLM(str(path), dtype="float32", **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts(2)],
                 SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts(batch)], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    llm.shutdown()
    return batch * tokens / elapsed


def run_transformers(path: Path, batch: int, tokens: int) -> float:
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    ids = torch.tensor(prompts(batch))
    with torch.inference_mode():
        model.generate(ids[:1], max_new_tokens=4, do_sample=False, pad_token_id=0)
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                       pad_token_id=0, eos_token_id=None)
        elapsed = time.perf_counter() - start
    return batch * tokens / elapsed


def step_time_batch1(path: Path, tokens: int, **kwargs) -> float:
    """Median decode step of one request (ms), from the engine's own step loop."""
    from kvray import LLM, SamplingParams

    llm = LLM(str(path), dtype="float32", **kwargs)
    engine = llm.llm_engine
    engine.add_request("r", {"prompt_token_ids": prompts(1)[0]},
                       SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True))
    times = []
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    llm.shutdown()
    return 1e3 * statistics.median(times[2:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--tp", action="store_true", help="also TP = 2 sliced vs expert-parallel")
    ap.add_argument("--int8", action="store_true", help="also quantization: int8 vs fp32")
    ap.add_argument("--layers", type=int, default=None,
                    help="decoder layers of both shapes (default 4): deeper models spread "
                         "the step's fixed host work (~0.5 ms) over more weights, as real "
                         "MoE models' 24-48 layers do")
    args = ap.parse_args()
    print(describe())
    print(f"torch threads: {torch.get_num_threads()}; fp32 weights and activations", flush=True)
    # probed again after each model's steps; the floors use the best probe of the run
    probes = [cache_probe()]
    rows, floors, int8_rows = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        for name in SHAPES:
            path = make_model(name, Path(tmp), args.layers)
            config = transformers.AutoConfig.from_pretrained(str(path))
            step = step_time_batch1(path, args.tokens)
            probes.append(cache_probe())
            for batch in (1, args.batch):
                ours = run_kvray(path, batch, args.tokens)
                theirs = run_transformers(path, batch, args.tokens)
                rows.append((name, batch, ours, theirs))
                print(f"  {name} batch {batch}: kvray {ours:.1f} tok/s, transformers "
                      f"{theirs:.1f} tok/s", flush=True)
            print(f"  {name}: batch-1 decode step {step:.2f} ms, touched weights "
                  f"{touched_bytes(config) / 2**20:.1f} MiB", flush=True)
            floors.append((name, step, touched_bytes(config)))
            if args.int8:
                step_q = step_time_batch1(path, args.tokens, quantization="int8")
                fp32_b = next(a for n, b, a, _ in rows if n == name and b == args.batch)
                tput_q = run_kvray(path, args.batch, args.tokens, quantization="int8")
                int8_rows.append((name, step, step_q, fp32_b, tput_q))
                print(f"  {name} int8: batch-1 step {step_q:.2f} ms, batch {args.batch} "
                      f"{tput_q:.1f} tok/s", flush=True)
        print("\n| model | batch | kvray tok/s | transformers tok/s | kvray / transformers |")
        print("|---|---|---|---|---|")
        for name, batch, a, b in rows:
            print(f"| {name} | {batch} | {a:.1f} | {b:.1f} | {a / b:.2f}x |")
        bandwidth, dram = max(probes), read_bandwidth()
        print(f"\nread bandwidth: {bandwidth / 1e9:.1f} GB/s, the best of "
              f"{' / '.join(f'{p / 1e9:.1f}' for p in probes)} (torch.sum over 256 MiB); "
              f"{dram / 1e9:.1f} GB/s over 1 GiB (decode_step.py's probe, past the caches)")
        print("\n| model | batch-1 step ms | read floor ms (touched weights), best / 1 GiB "
              "probe | step / floor |")
        print("|---|---|---|---|")
        for name, step, touched in floors:
            floor_ms, dram_ms = 1e3 * touched / bandwidth, 1e3 * touched / dram
            print(f"| {name} | {step:.2f} | {floor_ms:.2f} / {dram_ms:.2f} | "
                  f"{step / floor_ms:.2f}x / {step / dram_ms:.2f}x |")
        if int8_rows:
            print(f"\n| model | batch-1 step ms fp32 / int8 | batch-{args.batch} tok/s fp32 / "
                  "int8 | int8 / fp32 |")
            print("|---|---|---|---|")
            for name, step, step_q, fp, q in int8_rows:
                print(f"| {name} | {step:.2f} / {step_q:.2f} | {fp:.1f} / {q:.1f} | "
                      f"{step / step_q:.2f}x / {q / fp:.2f}x |")
        if args.tp:
            tp_table(Path(tmp), args)


def tp_table(root: Path, args: argparse.Namespace) -> None:
    import ray

    path = root / "mixtral"
    config = transformers.AutoConfig.from_pretrained(str(path))
    ray.init(num_cpus=4, _node_ip_address="127.0.0.1", include_dashboard=False,
             log_to_driver=False)
    h, inter, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    print("\n| layout (TP = 2) | step ms, batch 1 | output tok/s, batch "
          f"{args.batch} | expert bytes a rank reads per token (computed, mean) | "
          "all-reduce bytes per token (computed) |")
    print("|---|---|---|---|---|")
    try:
        for label, ep in (("experts sliced", False), ("expert parallel", True)):
            kw = dict(tensor_parallel_size=2, enable_expert_parallel=ep)
            step = step_time_batch1(path, args.tokens, **kw)
            tput = run_kvray(path, args.batch, args.tokens, **kw)
            # sliced: every chosen expert's half on each rank; EP: the chosen experts the
            # rank holds (on average half of them)
            expert_bytes = 4 * layers * config.num_experts_per_tok * 3 * h * inter / 2
            reduce_bytes = 4 * layers * 2 * h  # attention's and the MoE's all-reduce
            print(f"| {label} | {step:.2f} | {tput:.1f} | {expert_bytes / 2**20:.2f} MiB "
                  f"| {reduce_bytes / 1024:.1f} KiB |", flush=True)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
