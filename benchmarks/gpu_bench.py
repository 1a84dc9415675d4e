"""kvray against Hugging Face transformers on one GPU: decode step time, throughput, roofline.

Two random-weight Llama models are built at run time (nothing is downloaded; the
tokenizer is a generated word-level one with exactly the model's vocabulary, so any id
decodes):

- the shape of kvray's built-in SmolLM2-135M-Instruct (hidden 576, 30 layers, 9 heads,
  3 KV heads, MLP 1536, vocab 49152, tied embeddings);
- a ~1.1B Llama (hidden 2048, 16 layers, 32 heads, 8 KV heads, MLP 8192, vocab 32000).

Each runs under three systems: kvray with its defaults (CUDA graphs for decode on CUDA),
kvray with ``enforce_eager=True`` (skipped when this kvray has no such key) and
``transformers`` ``generate`` (static batch, greedy, KV cache on). Workloads, all greedy
with fixed lengths (kvray ``ignore_eos``; transformers without an EOS token):

- batch 1: one request, 128 prompt tokens, 256 output tokens. TPOT (ms per decode step)
  is kvray's first-token-to-finish time over 255 steps, and for transformers the time of
  ``generate(256)`` less ``generate(1)`` over 255; best of a few runs. "b1 tok/s" is
  1000 / TPOT, the decode rate.
- batch 64: 64 requests of 128 prompt tokens and 128 output tokens, submitted at once:
  output tokens per second, wall clock including the prefills.

The roofline floor of a batch-1 decode step is the bytes it must read (every weight the
step multiplies with, plus the mean KV cache of the sequence) over the copy bandwidth
measured in the same run (a large device-to-device ``copy_``, read + written bytes, timed
with CUDA events); "% of roofline" = floor / measured TPOT. A greedy parity check compares
kvray's first 32 tokens with transformers' on 4 prompts for the built-in shape (bf16 may
legitimately part ways after a near-tie: it is reported, not failed).

Prints one markdown table and writes ``gpu_bench.md`` and ``gpu_bench.json`` under
``--out`` (rewritten after every system, so a run cut short leaves what it measured).
No system is started after ``--time-budget`` seconds (default 240); the exit status is 1
if any system failed or was skipped.

Usage:
    python benchmarks/gpu_bench.py --out OUT_DIR            # on a CUDA machine, bf16
    python benchmarks/gpu_bench.py --out OUT_DIR --smoke    # tiny shapes, CPU, fp32
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.step_overhead import STEP_PARTS, Timers  # noqa: E402

H200_SPEC_BANDWIDTH = 4.8e12  # bytes/s, NVIDIA's HBM3e figure for the H200
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>")  # ids 0..3; prompts use ids above


@dataclass(frozen=True)
class ModelShape:
    """A Llama architecture to build with random weights."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tied: bool
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


@dataclass(frozen=True)
class Workload:
    """Request shapes of one run."""

    b1_prompt: int = 128
    b1_output: int = 256
    batch: int = 64
    batch_prompt: int = 128
    batch_output: int = 128
    parity_prompts: int = 4
    parity_prompt: int = 32
    parity_tokens: int = 32
    repeats: int = 2  # batch-1 timings: the best of this many

    @property
    def max_model_len(self) -> int:
        longest = max(self.b1_prompt + self.b1_output, self.batch_prompt + self.batch_output,
                      self.parity_prompt + self.parity_tokens)
        return 1 << (longest - 1).bit_length()  # next power of two


# The built-in model's shape, as in its config.json (its real weights do not travel).
BUILTIN_SHAPE = ModelShape("SmolLM2-135M shape", hidden=576, layers=30, heads=9, kv_heads=3,
                           intermediate=1536, vocab=49152, tied=True, rope_theta=100000.0)
LLAMA_1B = ModelShape("Llama 1.1B", hidden=2048, layers=16, heads=32, kv_heads=8,
                      intermediate=8192, vocab=32000, tied=False)
SMOKE_SHAPES = (
    ModelShape("SmolLM2 shape (smoke)", hidden=64, layers=2, heads=4, kv_heads=2,
               intermediate=128, vocab=512, tied=True),
    ModelShape("Llama (smoke)", hidden=96, layers=2, heads=4, kv_heads=2,
               intermediate=192, vocab=1024, tied=False),
)
SMOKE_WORKLOAD = Workload(b1_prompt=16, b1_output=16, batch=4, batch_prompt=16,
                          batch_output=8, parity_prompt=16, parity_tokens=16, repeats=1)

SYSTEM_DEFAULT = "kvray default"  # CUDA graphs for decode where kvray can use them
SYSTEM_EAGER = "kvray enforce_eager"
SYSTEM_HF = "transformers generate"


@dataclass
class Measurement:
    """What one system did on one model; None where it was not measured."""

    model: str
    system: str
    tpot_ms: float | None = None
    b1_tokens_per_s: float | None = None
    batch_tokens_per_s: float | None = None
    startup_s: float | None = None
    details: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


# ---- environment ---------------------------------------------------------------------------

def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def describe_environment(device: torch.device) -> dict[str, str]:
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "none"
    return {"python": platform.python_version(), "torch": torch.__version__,
            "triton": triton_version, "transformers": transformers.__version__,
            "cuda": str(torch.version.cuda), "gpu": gpu, "cpu": cpu_model(),
            "cpu_cores": str(len(os.sched_getaffinity(0)))}


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_copy_bandwidth(device: torch.device, num_bytes: int, repeats: int = 10) -> float:
    """Bytes per second (read + written) of the fastest ``dst.copy_(src)`` of ``num_bytes``."""
    src = torch.ones(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1e3
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            seconds = time.perf_counter() - t0
        best = min(best, seconds)
    del src, dst
    return 2 * num_bytes / best


# ---- model and tokenizer ---------------------------------------------------------------------

def build_tokenizer(vocab_size: int) -> transformers.PreTrainedTokenizerFast:
    """A word-level tokenizer whose ids are exactly 0..vocab_size-1 (id i >= 4 is the word
    ``w<i>``), so kvray's detokenizer can decode any id the model samples."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab.update({f"w{i}": i for i in range(len(SPECIAL_TOKENS), vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
        unk_token="<unk>")


def build_model(shape: ModelShape, dtype: torch.dtype, device: torch.device, path: Path,
                seed: int = 0) -> transformers.PreTrainedModel:
    """A random-weight Llama of ``shape`` in ``dtype`` on ``device``, also saved (with its
    tokenizer) to ``path`` for kvray. Weights are drawn with std 0.05 rather than 0.02 so
    that logits are not nearly flat (greedy near-ties make parity checks meaningless)."""
    config = transformers.LlamaConfig(
        vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim,
        max_position_embeddings=2048, rms_norm_eps=1e-5, tie_word_embeddings=shape.tied,
        rope_parameters={"rope_type": "default", "rope_theta": shape.rope_theta},
        initializer_range=0.05, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(seed)
    # Built directly in ``dtype`` (as from_pretrained(dtype=...) does), not cast after:
    # a cast would also round the fp32 rotary frequencies transformers keeps.
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = transformers.LlamaForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(default_dtype)
    model.save_pretrained(path)
    build_tokenizer(shape.vocab).save_pretrained(path)
    return model


def decode_bytes_per_step(model: torch.nn.Module, shape: ModelShape, context: float) -> float:
    """Bytes a batch-1 decode step must read: every weight it multiplies with (an untied
    input embedding contributes one row, counted as nothing) plus the KV cache of a
    ``context``-token sequence."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    if not shape.tied:
        emb = model.get_input_embeddings().weight
        weights -= emb.numel() * emb.element_size()
    elsize = next(model.parameters()).element_size()
    kv = 2 * shape.layers * shape.kv_heads * shape.head_dim * elsize * context
    return weights + kv


def warm_up(generate: Callable[[list[list[int]], int], Any], shape: ModelShape,
            wl: Workload) -> float:
    """One short run at each batch size (Triton compiles and autotunes, lazy set-up), the
    same for every system; returns its seconds."""
    t0 = time.perf_counter()
    generate(random_prompts(1, wl.b1_prompt, shape.vocab, seed=101), 8)
    generate(random_prompts(wl.batch, wl.batch_prompt, shape.vocab, seed=102), 4)
    return round(time.perf_counter() - t0, 3)


def random_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(len(SPECIAL_TOKENS), vocab, (count, length), generator=g)
    return ids.tolist()


# ---- systems ---------------------------------------------------------------------------------

def kvray_has_key(key: str) -> bool:
    from kvray.config import FIELD_SECTION

    return key in FIELD_SECTION


def kvray_block_count(wl: Workload, block_size: int = 16) -> int:
    """KV blocks for the largest batch at full length, plus a margin."""
    return wl.batch * -(-wl.max_model_len // block_size) + 64


def run_kvray(shape: ModelShape, path: Path, dtype: str, wl: Workload, eager: bool,
              parity_prompts: list[list[int]] | None) -> tuple[Measurement, list[list[int]]]:
    """Batch-1 TPOT and batch throughput of kvray on the model at ``path``; with
    ``parity_prompts``, also the greedy tokens for them."""
    from kvray import LLM, SamplingParams

    system = SYSTEM_EAGER if eager else SYSTEM_DEFAULT
    m = Measurement(shape.name, system)
    kwargs: dict[str, Any] = dict(
        dtype=dtype, max_model_len=wl.max_model_len, max_num_seqs=wl.batch,
        num_gpu_blocks_override=kvray_block_count(wl), gpu_memory_utilization=0.5)
    if eager:
        kwargs["enforce_eager"] = True
    t0 = time.perf_counter()
    llm = LLM(model=str(path), **kwargs)
    m.startup_s = time.perf_counter() - t0
    parity: list[list[int]] = []
    try:
        m.details.update(kvray_runner_facts(llm))

        def generate(prompts: list[list[int]], max_tokens: int) -> list[Any]:
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                use_tqdm=False)
            for o in outs:
                got = len(o.outputs[0].token_ids)
                if got != max_tokens:
                    raise RuntimeError(f"kvray gave {got} tokens, asked for {max_tokens}")
            return outs

        m.details["warmup_s"] = warm_up(generate, shape, wl)

        tpots = []
        for rep in range(wl.repeats):
            prompt = random_prompts(1, wl.b1_prompt, shape.vocab, seed=200 + rep)
            other = random_prompts(1, wl.b1_prompt, shape.vocab, seed=250 + rep)
            tpots.append(kvray_tpot(generate, prompt, other, wl.b1_output))
        m.tpot_ms = min(tpots) * 1e3
        m.b1_tokens_per_s = 1e3 / m.tpot_ms
        if not eager:
            try:
                m.details["step_ms"] = kvray_step_breakdown(llm, shape, wl)
                m.details["kernels_per_layer"] = kvray_kernels_per_layer(generate, shape, wl)
            except Exception as err:  # noqa: BLE001 - a diagnostic; the row stands without
                m.details["step_ms"] = {"error": f"{type(err).__name__}: {err}"}

        prompts = random_prompts(wl.batch, wl.batch_prompt, shape.vocab, seed=300)
        t0 = time.perf_counter()
        generate(prompts, wl.batch_output)
        m.batch_tokens_per_s = wl.batch * wl.batch_output / (time.perf_counter() - t0)

        if parity_prompts:
            outs = generate(parity_prompts, wl.parity_tokens)
            parity = [list(o.outputs[0].token_ids) for o in outs]
    finally:
        llm.shutdown()
    return m, parity


def kvray_tpot(generate: Callable[[list[list[int]], int], list[Any]], prompt: list[list[int]],
               other: list[list[int]], num_tokens: int) -> float:
    """Seconds per decode step of one request: its first-token-to-finish time over the
    decode steps, from the request's metrics; without metrics, a ``num_tokens`` generate
    less a one-token one of ``other`` (a prompt of the same length: no prefix-cache hit)."""
    t0 = time.perf_counter()
    out = generate(prompt, num_tokens)[0]
    total = time.perf_counter() - t0
    metrics = getattr(out, "metrics", None)
    first = getattr(metrics, "first_token_time", None)
    finished = getattr(metrics, "finished_time", None)
    if first is not None and finished is not None and finished > first:
        return (finished - first) / (num_tokens - 1)
    t0 = time.perf_counter()
    generate(other, 1)
    return (total - (time.perf_counter() - t0)) / (num_tokens - 1)


def kvray_kernels_per_layer(generate: Callable[[list[list[int]], int], list[Any]],
                            shape: ModelShape, wl: Workload, steps: int = 16) -> float | None:
    """CUDA kernels per batch-1 decode step over the layers, by the profiler: a generate of
    1 + ``steps`` tokens less a one-token one, over ``steps`` and the layers (the step's LM
    head and sampling, a few kernels, are included). None without CUDA."""
    from benchmarks.quant_step import cuda_kernels

    prompt = random_prompts(1, wl.b1_prompt, shape.vocab, seed=500)
    other = random_prompts(1, wl.b1_prompt, shape.vocab, seed=501)
    long = cuda_kernels(lambda: generate(prompt, steps + 1))
    short = cuda_kernels(lambda: generate(other, 1))
    if long is None or short is None or long <= short:
        return None
    return (long - short) / steps / shape.layers


def kvray_step_breakdown(llm: Any, shape: ModelShape, wl: Workload, steps: int = 64
                         ) -> dict[str, float]:
    """Milliseconds per batch-1 decode step spent in each part of kvray's step (the
    scheduler, the runner's state update and input preparation, the forward pass — the
    graph replay —, the LM head, sampling) and the rest (applying outputs, detokenizing,
    bookkeeping). Each part synchronizes the device before and after, so GPU work is
    charged to the part that launched it; that serializes host and device, so the parts
    add up to more than the plain TPOT: they say where a step's time goes. Empty when the
    runner is not in this process."""
    from kvray import SamplingParams

    engine = llm.llm_engine
    runner = getattr(getattr(engine.executor, "worker", None), "runner", None)
    if runner is None:
        return {}
    timers = Timers(sync=lambda: synchronize(runner.device))
    timers.wrap_step(engine, runner)
    totals = dict.fromkeys(("step", *STEP_PARTS, "rest"), 0.0)
    counted = 0
    try:
        steps = min(steps, wl.max_model_len - wl.b1_prompt - 1)
        prompt = random_prompts(1, wl.b1_prompt, shape.vocab, seed=500)[0]
        params = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True)
        engine.add_request("step-breakdown", prompt, params)
        prefill = True
        while engine.has_unfinished_requests():
            timers.current.clear()
            t0 = time.perf_counter()
            engine.step()
            wall = time.perf_counter() - t0
            if prefill:  # the first step computes the prompt: not a decode step
                prefill = False
                continue
            counted += 1
            totals["step"] += wall
            for part in STEP_PARTS:
                totals[part] += timers.current[part]
            totals["rest"] += wall - sum(timers.current.values())
    finally:
        timers.unwrap()
    return {k: round(1e3 * v / max(counted, 1), 3) for k, v in totals.items()} | {
        "steps": counted}


def kvray_runner_facts(llm: Any) -> dict[str, Any]:
    """Which attention backend kvray picked and whether it holds CUDA graphs (read from
    the in-process worker; empty where that is not reachable)."""
    runner = getattr(getattr(llm.llm_engine.executor, "worker", None), "runner", None)
    if runner is None:
        return {}
    facts: dict[str, Any] = {"attention_backend": getattr(runner, "attention_backend", None)}
    if hasattr(runner, "graphs"):
        graphs = runner.graphs
        facts["cuda_graphs"] = graphs is not None
        sizes = getattr(graphs, "sizes", None)
        if sizes is not None:
            facts["cuda_graph_sizes"] = list(sizes)
    return facts


def run_transformers(shape: ModelShape, model: transformers.PreTrainedModel,
                     device: torch.device, wl: Workload,
                     parity_prompts: list[list[int]] | None
                     ) -> tuple[Measurement, list[list[int]]]:
    """The same workloads through ``model.generate`` (greedy, no EOS, so every sequence
    has exactly the asked length)."""
    m = Measurement(shape.name, SYSTEM_HF)
    # No EOS at all: greedy argmax every step, as kvray's ignore_eos (generate would
    # otherwise fill an unset eos_token_id from the model's generation config).
    model.generation_config.eos_token_id = None
    m.details["attn_implementation"] = getattr(model.config, "_attn_implementation", None)

    @torch.inference_mode()
    def generate(prompts: list[list[int]], max_new_tokens: int) -> torch.Tensor:
        ids = torch.tensor(prompts, device=device)
        config = transformers.GenerationConfig(
            max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False,
            use_cache=True, eos_token_id=None, pad_token_id=0, bos_token_id=1)
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                             generation_config=config)
        synchronize(device)
        new = out[:, ids.shape[1]:]
        if new.shape[1] != max_new_tokens:
            raise RuntimeError(f"transformers gave {new.shape[1]} tokens, asked for "
                               f"{max_new_tokens}")
        return new

    def timed(prompts: list[list[int]], max_new_tokens: int) -> float:
        t0 = time.perf_counter()
        generate(prompts, max_new_tokens)
        return time.perf_counter() - t0

    m.details["warmup_s"] = warm_up(generate, shape, wl)

    tpots = []
    for rep in range(wl.repeats):
        prompt = random_prompts(1, wl.b1_prompt, shape.vocab, seed=200 + rep)
        full = timed(prompt, wl.b1_output)
        prefill = timed(prompt, 1)
        tpots.append((full - prefill) / (wl.b1_output - 1))
    m.tpot_ms = min(tpots) * 1e3
    m.b1_tokens_per_s = 1e3 / m.tpot_ms

    prompts = random_prompts(wl.batch, wl.batch_prompt, shape.vocab, seed=300)
    m.batch_tokens_per_s = wl.batch * wl.batch_output / timed(prompts, wl.batch_output)

    parity = generate(parity_prompts, wl.parity_tokens).tolist() if parity_prompts else []
    return m, parity


def release_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def compare_tokens(kvray_tokens: list[list[int]], hf_tokens: list[list[int]]
                   ) -> dict[str, Any]:
    """How many sequences agree token for token, and where the others first differ."""
    first_diff = []
    for a, b in zip(kvray_tokens, hf_tokens, strict=True):
        diff = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
        first_diff.append(diff)
    return {"equal": sum(d is None for d in first_diff), "of": len(first_diff),
            "first_difference_at": first_diff}


# ---- report ----------------------------------------------------------------------------------

def fmt(value: float | None, digits: int = 1) -> str:
    return "—" if value is None else f"{value:,.{digits}f}"


def ratio(a: float | None, b: float | None) -> str:
    return "—" if a is None or b is None or b == 0 else f"{a / b:.2f}x"


def kernels(details: dict[str, Any]) -> str:
    """The attention kernels a system ran, and CUDA graphs when kvray replayed them."""
    name = details.get("attention_backend") or details.get("attn_implementation") or "?"
    name = f"{name} + CUDA graphs" if details.get("cuda_graphs") else name
    per_layer = details.get("kernels_per_layer")
    return name if per_layer is None else f"{name}, {per_layer:.1f} kernels/layer"


def render(report: dict[str, Any]) -> str:
    """The header lines and the one table."""
    env, wl = report["environment"], report["workload"]
    bw = report.get("copy_bandwidth_bytes_per_s")
    lines = [
        f"GPU: {env['gpu']} | CPU: {env['cpu']} ({env['cpu_cores']} cores)",
        f"python {env['python']}, torch {env['torch']} (CUDA {env['cuda']}), "
        f"triton {env['triton']}, transformers {env['transformers']}",
        f"copy bandwidth measured: {fmt(bw and bw / 1e12, 2)} TB/s (read + write); "
        f"H200 spec: {H200_SPEC_BANDWIDTH / 1e12:.1f} TB/s",
        f"batch 1: prompt {wl['b1_prompt']}, output {wl['b1_output']}; batch {wl['batch']}: "
        f"prompt {wl['batch_prompt']}, output {wl['batch_output']}; greedy, fixed lengths",
    ]
    for name, parity in report["parity"].items():
        diffs = ", ".join("=" if d is None else f"≠@{d}" for d in parity["first_difference_at"])
        lines.append(f"greedy parity {name} (first {wl['parity_tokens']} tokens): tokens "
                     f"equal: {parity['equal']}/{parity['of']} ({diffs})")
    b = wl["batch"]
    lines += ["", f"| model | system | kernels | b1 TPOT ms | b1 tok/s | b1 floor ms "
                  f"| % of roofline | b{b} out tok/s | b1 vs HF | b{b} vs HF |",
              "|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for model in report["models"]:
        rows = [r for r in report["results"] if r["model"] == model["name"]]
        hf = next((r for r in rows if r["system"] == SYSTEM_HF and not r["error"]), None)
        params = f"{model['params']:,} params, " if model.get("params") else ""
        label = f"{model['name']} ({params}{model['dtype']})"
        floor = model.get("tpot_floor_ms")
        for r in rows:
            if r["error"]:
                what = r["error"] if r["error"].startswith("skipped") else \
                    f"failed: {r['error'][:100]}"
                lines.append(f"| {label} | {r['system']} | {what} | | | | | | | |")
                continue
            pct = None if r["tpot_ms"] is None or floor is None else 100 * floor / r["tpot_ms"]
            lines.append(
                f"| {label} | {r['system']} | {kernels(r['details'])} | {fmt(r['tpot_ms'], 2)} "
                f"| {fmt(r['b1_tokens_per_s'])} | {fmt(floor, 3)} | {fmt(pct)} "
                f"| {fmt(r['batch_tokens_per_s'])} "
                f"| {ratio(r['b1_tokens_per_s'], hf and hf['b1_tokens_per_s'])} "
                f"| {ratio(r['batch_tokens_per_s'], hf and hf['batch_tokens_per_s'])} |")
    breakdowns = [r for r in report["results"]
                  if isinstance(r["details"].get("step_ms"), dict) and
                  "step" in r["details"]["step_ms"]]
    if breakdowns:
        parts = ("step", *STEP_PARTS, "rest")
        lines += ["", "batch-1 decode step of kvray default, ms per step by part (each part "
                  "synchronized with the device: GPU work is charged to the part that "
                  "launched it; 'rest' = applying outputs, detokenizing, bookkeeping):", "",
                  "| model | " + " | ".join(parts) + " |",
                  "|---|" + "---:|" * len(parts)]
        for r in breakdowns:
            ms = r["details"]["step_ms"]
            lines.append(f"| {r['model']} | " + " | ".join(fmt(ms.get(p), 3) for p in parts)
                         + " |")
    return "\n".join(lines)


def write_report(report: dict[str, Any], out: Path) -> str:
    out.mkdir(parents=True, exist_ok=True)
    text = render(report)
    (out / "gpu_bench.md").write_text(text + "\n")
    (out / "gpu_bench.json").write_text(json.dumps(report, indent=2) + "\n")
    return text


# ---- main ------------------------------------------------------------------------------------

def bench_model(shape: ModelShape, dtype: torch.dtype, device: torch.device, wl: Workload,
                bandwidth: float, root: Path, report: dict[str, Any], out: Path,
                with_parity: bool, deadline: float) -> None:
    """Build one model, run every system on it and add the results to ``report``; a system
    not started by ``deadline`` (``time.monotonic()``) is skipped."""
    dtype_name = str(dtype).removeprefix("torch.")
    if time.monotonic() > deadline:
        print(f"[{shape.name}] skipped: past the time budget", flush=True)
        report["models"].append({"name": shape.name, "params": None, "dtype": dtype_name,
                                 "shape": asdict(shape)})
        report["results"].append(asdict(Measurement(shape.name, SYSTEM_DEFAULT,
                                                    error="skipped: past the time budget")))
        return
    path = root / shape.name.replace(" ", "_").replace("(", "").replace(")", "")
    t0 = time.perf_counter()
    model = build_model(shape, dtype, device, path)
    params = sum(p.numel() for p in model.parameters())
    context = wl.b1_prompt + wl.b1_output / 2  # mean sequence length over the decode
    floor_ms = decode_bytes_per_step(model, shape, context) / bandwidth * 1e3
    info = {"name": shape.name, "params": params, "dtype": dtype_name, "shape": asdict(shape),
            "build_s": round(time.perf_counter() - t0, 2),
            "decode_bytes_per_step": decode_bytes_per_step(model, shape, context),
            "tpot_floor_ms": floor_ms}
    report["models"].append(info)
    print(f"[{shape.name}] built: {params:,} params, {dtype_name}, {info['build_s']} s",
          flush=True)
    parity_prompts = (random_prompts(wl.parity_prompts, wl.parity_prompt, shape.vocab, 400)
                      if with_parity else None)
    tokens: dict[str, list[list[int]]] = {}
    # The eager row last: if time runs out, the comparison with transformers is complete.
    systems: list[tuple[str, Callable[[], tuple[Measurement, list[list[int]]]]]] = [
        (SYSTEM_DEFAULT, lambda: run_kvray(shape, path, dtype_name, wl, False, parity_prompts)),
        (SYSTEM_HF, lambda: run_transformers(shape, model, device, wl, parity_prompts))]
    if kvray_has_key("enforce_eager"):
        systems.append((SYSTEM_EAGER,
                        lambda: run_kvray(shape, path, dtype_name, wl, True, None)))
    else:
        print(f"[{shape.name}] this kvray has no enforce_eager key: no eager row", flush=True)
    for system, run in systems:
        t0 = time.perf_counter()
        if time.monotonic() > deadline:
            m = Measurement(shape.name, system, error="skipped: past the time budget")
            report["results"].append(asdict(m))
            print(f"[{shape.name}] {system}: {m.error}", flush=True)
            continue
        try:
            m, toks = run()
            if toks:
                tokens[system] = toks
        except Exception as err:  # noqa: BLE001 - report it, go on with the next system
            traceback.print_exc()
            m = Measurement(shape.name, system, error=f"{type(err).__name__}: {err}")
        release_memory()
        m.details["wall_s"] = round(time.perf_counter() - t0, 2)
        report["results"].append(asdict(m))
        print(f"[{shape.name}] {system}: TPOT {fmt(m.tpot_ms, 2)} ms, batch "
              f"{fmt(m.batch_tokens_per_s)} tok/s, {m.details} {m.error or ''}", flush=True)
        write_report(report, out)
    if SYSTEM_DEFAULT in tokens and SYSTEM_HF in tokens:
        report["parity"][shape.name] = compare_tokens(tokens[SYSTEM_DEFAULT], tokens[SYSTEM_HF])
        report["parity"][shape.name]["tokens"] = tokens


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "gpu_check_out"),
                        help="folder for gpu_bench.md and gpu_bench.json")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny models and workloads (for a CPU check of the script)")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda if any)")
    parser.add_argument("--time-budget", type=float, default=240.0,
                        help="seconds after which no further system is started (default 240; "
                        "gpu_check.sh kills the run at 300)")
    args = parser.parse_args(argv)

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    on_cuda = device.type == "cuda"
    dtype = torch.bfloat16 if on_cuda else torch.float32
    shapes = SMOKE_SHAPES if args.smoke else (BUILTIN_SHAPE, LLAMA_1B)
    wl = SMOKE_WORKLOAD if args.smoke else Workload()
    out = Path(args.out)

    start = time.perf_counter()
    deadline = time.monotonic() + args.time_budget
    env = describe_environment(device)
    copy_bytes = (2 << 30) if on_cuda else (64 << 20)
    bandwidth = measure_copy_bandwidth(device, copy_bytes)
    release_memory()
    print(f"environment: {env}\ncopy bandwidth: {bandwidth / 1e12:.3f} TB/s", flush=True)
    report: dict[str, Any] = {
        "environment": env, "device": str(device), "smoke": args.smoke,
        "workload": asdict(wl), "copy_bandwidth_bytes_per_s": bandwidth,
        "h200_spec_bandwidth_bytes_per_s": H200_SPEC_BANDWIDTH,
        "models": [], "results": [], "parity": {}}
    with tempfile.TemporaryDirectory(prefix="kvray_gpu_bench_") as tmp:
        for i, shape in enumerate(shapes):
            bench_model(shape, dtype, device, wl, bandwidth, Path(tmp), report, out,
                        with_parity=i == 0, deadline=deadline)
            release_memory()
    report["total_s"] = round(time.perf_counter() - start, 1)
    text = write_report(report, out)
    print("\n" + text + f"\n\n(total {report['total_s']} s; written to {out}/gpu_bench.md "
          "and gpu_bench.json)", flush=True)
    return 1 if any(r["error"] for r in report["results"]) else 0


if __name__ == "__main__":
    sys.exit(main())
