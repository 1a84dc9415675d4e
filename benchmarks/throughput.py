"""Offline throughput: kvray vs transformers static batching on the same workload.

Runs one seeded workload (random prompt token ids, fixed output lengths, EOS ignored)
through transformers ``generate`` in static batches and through ``kvray.LLM`` in the same
process, on the built-in SmolLM2-135M-Instruct, and prints a markdown table. Both systems
run the dtype kvray's ``auto`` picks for this CPU (bf16 only where it is native, else fp32)
unless ``--dtype`` says otherwise. It also measures the matmul peak in that dtype and
kvray's model FLOP/s during pure-decode steps.

Workloads (``--workload``): ``uniform`` lengths, ``chat`` (log-normal lengths, prompt median
~120 and output median ~90 tokens) and ``prefix`` (90 % of every prompt is one shared system
prompt, which prefix caching computes once).

Peer mode (``--peer openvino``): instead of transformers, OpenVINO GenAI's continuous-batching
pipeline (``ContinuousBatchingPipeline`` with a ``SchedulerConfig``, prefix caching on) on the
built-in model exported with ``optimum-cli export openvino --weight-format int8``, in its own
venv (``benchmarks/peer_openvino.sh`` makes both, once), driven as a subprocess that prints
JSON; kvray runs the same requests first, in each of ``--kvray-variants`` (default ``int8``:
the Hugging Face checkpoint with ``quantization: int8``; ``int8+kvint8``: the same with an
int8 KV cache, like OpenVINO's own CPU default of a u8 KV cache; and ``Q8_0``: the Q8_0 GGUF
that ``benchmarks/peer_llamacpp.sh --kld`` makes). Defaults then: the ``chat`` workload, 48
requests; the table gives each kvray / OpenVINO ratio (target >= 1.2x).

Usage:
    python benchmarks/throughput.py [--workload uniform|chat|prefix] [--num-requests 128]
        [--seed 0] [--skip-baseline]
        [--skip-kvray] [--max-num-seqs N] [--max-num-batched-tokens N] [--dtype D]
        [--json PATH]
    python benchmarks/throughput.py --peer openvino [--kvray-variants int8,Q8_0,int8+kvint8]
        [--openvino-weights int8] [--kv-cache-dtype D] [--rounds N] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
TARGET_SPEEDUP = 5.0
TARGET_DECODE_EFFICIENCY = 0.30
TARGET_PEER_SPEEDUP = 1.2  # kvray int8 / Q8_0 vs OpenVINO GenAI int8
WARMUP_REQUESTS = 4


@dataclass
class Request:
    """One benchmark request: prompt token ids and the exact number of tokens to generate."""

    prompt_ids: list[int]
    output_len: int


@dataclass
class RunResult:
    """Wall time and token counts of one system on the workload."""

    system: str
    wall_s: float
    num_requests: int
    prompt_tokens: int
    output_tokens: int
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def requests_per_s(self) -> float:
        return self.num_requests / self.wall_s

    @property
    def output_tok_per_s(self) -> float:
        return self.output_tokens / self.wall_s

    @property
    def total_tok_per_s(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.wall_s

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(requests_per_s=self.requests_per_s, output_tok_per_s=self.output_tok_per_s,
                 total_tok_per_s=self.total_tok_per_s)
        return d


# --------------------------------------------------------------------------- workload


def make_workload(n: int, seed: int, vocab_size: int, prompt_range: tuple[int, int],
                  output_range: tuple[int, int], kind: str = "uniform") -> list[Request]:
    """``n`` seeded requests, token ids in [100, vocab-100), lengths by ``kind``:

    - ``uniform``: prompt and output lengths uniform in their ranges;
    - ``chat``: log-normal lengths like chat traffic (prompt median 120, output median 90,
      sigma 0.7), clipped to the ranges;
    - ``prefix``: every prompt is one shared system prompt (90 % of its length, the upper
      end of the prompt range) plus its own question; outputs uniform.
    """
    rng = random.Random(seed)
    shared = [rng.randrange(100, vocab_size - 100) for _ in range(prompt_range[1] * 9 // 10)]
    requests = []
    for _ in range(n):
        if kind == "chat":
            plen = _clip(round(rng.lognormvariate(math.log(120), 0.7)), prompt_range)
            olen = _clip(round(rng.lognormvariate(math.log(90), 0.7)), output_range)
        else:
            plen, olen = rng.randint(*prompt_range), rng.randint(*output_range)
        prefix = shared if kind == "prefix" else []
        own = max(1, plen - len(prefix)) if kind == "prefix" else plen
        ids = prefix + [rng.randrange(100, vocab_size - 100) for _ in range(own)]
        requests.append(Request(ids, olen))
    return requests


def _clip(value: int, bounds: tuple[int, int]) -> int:
    return max(bounds[0], min(bounds[1], value))


def warmup_workload(vocab_size: int, seed: int) -> list[Request]:
    """A few tiny requests (distinct seed, so they share no prefix with the workload)."""
    return make_workload(WARMUP_REQUESTS, seed + 10_000, vocab_size, (16, 16), (4, 4))


# --------------------------------------------------------------------------- model facts


def model_config(model_dir: Path) -> dict[str, Any]:
    """The HF ``config.json`` of the model directory."""
    return json.loads((model_dir / "config.json").read_text())


def matmul_params_per_token(cfg: dict[str, Any]) -> int:
    """Weights used in matmuls per token: decoder-layer linears plus the LM head."""
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads", heads)
    head_dim = cfg.get("head_dim") or hidden // heads
    qkvo = 2 * heads * head_dim + 2 * kv_heads * head_dim
    per_layer = hidden * qkvo + 3 * hidden * cfg["intermediate_size"]
    return cfg["num_hidden_layers"] * per_layer + cfg["vocab_size"] * hidden


def attention_flops(cfg: dict[str, Any], context_tokens: int) -> float:
    """QK^T and PV FLOPs summed over tokens whose context lengths sum to ``context_tokens``."""
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    return 4.0 * cfg["num_hidden_layers"] * heads * head_dim * context_tokens


def matmul_peak_flops(dtype: torch.dtype, n: int = 2048, seconds: float = 1.5,
                      windows: int = 6) -> float:
    """``torch.mm`` FLOP/s in ``dtype`` on n x n matrices: the best of ``windows`` windows.

    The best window (not the mean) is the peak, so a burst of load from another process on
    the machine during one window does not lower it.
    """
    a = torch.randn(n, n, dtype=dtype)
    b = torch.randn(n, n, dtype=dtype)
    for _ in range(3):
        torch.mm(a, b)
    t0 = time.perf_counter()
    torch.mm(a, b)
    one = max(time.perf_counter() - t0, 1e-6)
    reps = max(2, int(seconds / windows / one))
    best = 0.0
    for _ in range(windows):
        t0 = time.perf_counter()
        for _ in range(reps):
            torch.mm(a, b)
        best = max(best, 2.0 * n**3 * reps / (time.perf_counter() - t0))
    return best


# --------------------------------------------------------------------------- baseline


def load_hf(model_dir: Path, dtype: str) -> tuple[Any, int]:
    """The transformers model in ``dtype`` (eval mode) and the pad id (eos when none)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    return model, int(pad)


def left_pad(batch: list[Request], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded input ids and the matching attention mask."""
    width = max(len(r.prompt_ids) for r in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for i, r in enumerate(batch):
        ids[i, width - len(r.prompt_ids):] = torch.tensor(r.prompt_ids)
        mask[i, width - len(r.prompt_ids):] = 1
    return ids, mask


def hf_generate_batch(model: Any, batch: list[Request], pad_id: int) -> list[list[int]]:
    """Greedy static-batch generate of the batch's longest output length; own tokens only."""
    ids, mask = left_pad(batch, pad_id)
    steps = max(r.output_len for r in batch)
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=steps,
                             min_new_tokens=steps, do_sample=False, pad_token_id=pad_id,
                             temperature=None, top_p=None, top_k=None)
    new = out[:, ids.shape[1]:]
    if new.shape[1] != steps:
        raise RuntimeError(f"transformers generated {new.shape[1]} tokens, expected {steps}")
    return [new[i, : r.output_len].tolist() for i, r in enumerate(batch)]


def batches(requests: list[Request], size: int) -> list[list[Request]]:
    """Consecutive batches of ``size`` requests in arrival order (the last may be short)."""
    return [requests[i:i + size] for i in range(0, len(requests), size)]


def run_baseline(model_dir: Path, requests: list[Request], warmup: list[Request],
                 batch_size: int, dtype: str) -> RunResult:
    """Static batching in arrival order; only each request's own tokens count as output."""
    model, pad_id = load_hf(model_dir, dtype)
    hf_generate_batch(model, warmup, pad_id)
    outputs: list[list[int]] = []
    t0 = time.perf_counter()
    for batch in batches(requests, batch_size):
        outputs.extend(hf_generate_batch(model, batch, pad_id))
        print(f"  baseline: {len(outputs)}/{len(requests)} requests, "
              f"{time.perf_counter() - t0:.1f} s", flush=True)
    wall = time.perf_counter() - t0
    computed = sum(len(b) * max(r.output_len for r in b)
                   for b in batches(requests, batch_size))
    useful = sum(len(o) for o in outputs)
    return RunResult(f"transformers static batch {batch_size}", wall, len(requests),
                     sum(len(r.prompt_ids) for r in requests), useful,
                     {"computed_output_tokens": computed, "outputs": outputs})


# --------------------------------------------------------------------------- kvray


def import_kvray() -> tuple[Any, Any] | str:
    """``(LLM, SamplingParams)`` from kvray, or the reason they cannot be imported."""
    try:
        from kvray import LLM, SamplingParams
    except ImportError as e:
        return f"{type(e).__name__}: {e}"
    return LLM, SamplingParams


def kvray_generate(llm: Any, sampling_cls: Any, requests: list[Request]) -> list[list[int]]:
    """Greedy, EOS-ignoring generation of exactly each request's output length."""
    params = [sampling_cls(temperature=0.0, max_tokens=r.output_len, ignore_eos=True)
              for r in requests]
    prompts = [{"prompt_token_ids": r.prompt_ids} for r in requests]
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


DECODE_KEYS = ("decode_time_s", "decode_tokens", "decode_context_tokens")
COUNTER_KEYS = ("num_steps", "num_preemptions", "prompt_tokens_total",
                "generation_tokens_total", "prefix_cache_queries", "prefix_cache_hits")


def engine_counters(llm: Any) -> dict[str, float]:
    """The engine's cumulative counters in ``llm.llm_engine.stats`` (missing ones read as 0)."""
    stats = getattr(getattr(llm, "llm_engine", None), "stats", None)
    return {k: float(getattr(stats, k, 0.0) or 0.0) for k in DECODE_KEYS + COUNTER_KEYS}


def engine_settings(llm: Any) -> dict[str, Any]:
    """Best effort: the engine's effective scheduler and cache settings."""
    config = getattr(getattr(llm, "llm_engine", None), "config", None)
    settings: dict[str, Any] = {}
    for section in ("scheduler", "cache"):
        obj = getattr(config, section, None)
        if hasattr(obj, "model_dump"):
            settings.update(obj.model_dump(mode="json"))
    return settings


def run_kvray(classes: tuple[Any, Any], requests: list[Request], warmup: list[Request],
              engine_kwargs: dict[str, Any], dtype: str) -> RunResult:
    """kvray on the workload after a warm-up; decode counters are deltas over the timed run."""
    llm_cls, sampling_cls = classes
    llm = llm_cls(**{"model": None, "dtype": dtype, "enable_prefix_caching": True,
                     **engine_kwargs})
    settings = engine_settings(llm)
    print(f"  kvray engine settings: {settings or 'n/a'}", flush=True)
    kvray_generate(llm, sampling_cls, warmup)
    before = engine_counters(llm)
    t0 = time.perf_counter()
    outputs = kvray_generate(llm, sampling_cls, requests)
    wall = time.perf_counter() - t0
    after = engine_counters(llm)
    delta = {k: after[k] - before[k] for k in after}
    print("  kvray counters over the timed run: "
          + ", ".join(f"{k}={delta[k]:g}" for k in COUNTER_KEYS), flush=True)
    wrong = [i for i, (o, r) in enumerate(zip(outputs, requests, strict=True))
             if len(o) != r.output_len]
    if wrong:
        print(f"  WARNING: {len(wrong)} kvray outputs have the wrong length "
              f"(first: request {wrong[0]}: {len(outputs[wrong[0]])} != "
              f"{requests[wrong[0]].output_len})", flush=True)
    useful = sum(min(len(o), r.output_len) for o, r in zip(outputs, requests, strict=True))
    llm.shutdown()  # its memory back before whatever runs next
    return RunResult("kvray", wall, len(requests), sum(len(r.prompt_ids) for r in requests),
                     useful, {"decode": {k: delta[k] for k in DECODE_KEYS},
                              "counters": {k: delta[k] for k in COUNTER_KEYS},
                              "engine_settings": settings, "wrong_lengths": len(wrong),
                              "outputs": outputs})


# --------------------------------------------------------------------------- report


def greedy_agreement(a: list[list[int]], b: list[list[int]], k: int = 8) -> int:
    """How many requests have identical first ``k`` generated tokens in both runs."""
    return sum(x[:k] == y[:k] for x, y in zip(a, b, strict=True))


def format_table(rows: list[list[str]]) -> str:
    """An aligned markdown table; the first row is the header."""
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    lines = ["| " + " | ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)) + " |"
             for r in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def result_row(r: RunResult) -> list[str]:
    return [r.system, f"{r.requests_per_s:.3f}", f"{r.output_tok_per_s:.1f}",
            f"{r.total_tok_per_s:.1f}", f"{r.wall_s:.1f}"]


def ratio_row(kv: RunResult, base: RunResult) -> list[str]:
    speed = kv.output_tok_per_s / base.output_tok_per_s
    mark = "met" if speed >= TARGET_SPEEDUP else "NOT met"
    return [f"ratio kvray / baseline (target >= {TARGET_SPEEDUP:g}x: {mark})",
            f"{kv.requests_per_s / base.requests_per_s:.3g}x", f"{speed:.3g}x",
            f"{kv.total_tok_per_s / base.total_tok_per_s:.3g}x",
            f"{kv.wall_s / base.wall_s:.3g}x"]


def decode_efficiency(kv: RunResult, cfg: dict[str, Any], peak: float) -> dict[str, float]:
    """Achieved model FLOP/s in pure-decode steps and its fraction of the matmul peak."""
    d = kv.extra["decode"]
    if d["decode_time_s"] <= 0 or d["decode_tokens"] <= 0:
        return {}
    flops = (d["decode_tokens"] * 2 * matmul_params_per_token(cfg)
             + attention_flops(cfg, int(d["decode_context_tokens"])))
    achieved = flops / d["decode_time_s"]
    return {"decode_flops": flops, "decode_flop_per_s": achieved,
            "decode_efficiency": achieved / peak,
            "decode_tok_per_s": d["decode_tokens"] / d["decode_time_s"]}


def print_efficiency(eff: dict[str, float], peak: float, dtype: str) -> None:
    print(f"{dtype} matmul peak (torch.mm 2048^3): {peak / 1e9:.1f} GFLOP/s")
    if not eff:
        print("kvray decode GFLOP/s: n/a (engine stats report no pure-decode steps)")
        return
    mark = "met" if eff["decode_efficiency"] >= TARGET_DECODE_EFFICIENCY else "NOT met"
    print(f"kvray decode: {eff['decode_flop_per_s'] / 1e9:.1f} GFLOP/s, "
          f"{eff['decode_tok_per_s']:.1f} tok/s in pure-decode steps")
    print(f"kvray decode efficiency: {100 * eff['decode_efficiency']:.1f}% of matmul peak "
          f"(target >= {100 * TARGET_DECODE_EFFICIENCY:.0f}%: {mark})")


def report(results: dict[str, RunResult], eff: dict[str, float], peak: float,
           dtype: str) -> None:
    """Print the throughput table, the ratio row and the efficiency lines."""
    rows = [["system", "requests/s", "output tok/s", "total tok/s", "wall s"]]
    rows += [result_row(r) for r in results.values()]
    if "baseline" in results and "kvray" in results:
        rows.append(ratio_row(results["kvray"], results["baseline"]))
    print()
    print(f"dtype: {dtype} (both systems)")
    print(format_table(rows))
    print()
    if "baseline" in results:
        b = results["baseline"]
        print(f"baseline computed {b.extra['computed_output_tokens']} output tokens, "
              f"{b.output_tokens} useful")
    if "baseline" in results and "kvray" in results:
        same = greedy_agreement(results["kvray"].extra["outputs"],
                                results["baseline"].extra["outputs"])
        print(f"greedy agreement (informational, {dtype}): first 8 tokens identical in "
              f"{same}/{results['kvray'].num_requests} requests")
    print_efficiency(eff, peak, dtype)


def write_json(path: Path, config: dict[str, Any], results: dict[str, RunResult],
               eff: dict[str, float], peak: float, kvray_error: str | None) -> None:
    """All numbers (without the generated tokens) as JSON."""
    runs = {}
    for name, r in results.items():
        d = r.to_dict()
        d["extra"] = {k: v for k, v in d["extra"].items() if k != "outputs"}
        runs[name] = d
    data = {"config": config, "results": runs, "matmul_peak_flop_per_s": peak,
            "kvray_decode": eff, "kvray_error": kvray_error,
            "targets": {"speedup": TARGET_SPEEDUP,
                        "decode_efficiency": TARGET_DECODE_EFFICIENCY}}
    if "baseline" in results and "kvray" in results:
        data["speedup_output_tok_per_s"] = (results["kvray"].output_tok_per_s
                                            / results["baseline"].output_tok_per_s)
    path.write_text(json.dumps(data, indent=2) + "\n")
    print(f"wrote {path}")


# --------------------------------------------------------------------------- OpenVINO peer


def openvino_driver(spec_path: Path) -> int:
    """Run inside OpenVINO's venv (no kvray there): the requests of ``spec_path`` through
    ``ContinuousBatchingPipeline``, after a warm-up; prints one JSON line with the wall time,
    the tokens and the pipeline's settings."""
    import numpy as np
    import openvino as ov
    import openvino_genai as ov_genai

    spec = json.loads(spec_path.read_text())
    sched = ov_genai.SchedulerConfig()
    sched.cache_size = spec["cache_gb"]
    sched.max_num_seqs = spec["max_num_seqs"]
    sched.max_num_batched_tokens = spec["max_num_batched_tokens"]
    sched.enable_prefix_caching = True
    sched.dynamic_split_fuse = True
    t0 = time.perf_counter()
    pipe = ov_genai.ContinuousBatchingPipeline(spec["model_dir"], sched, "CPU")
    load_s = time.perf_counter() - t0

    def generate(reqs: list[list]) -> list[list[int]]:
        inputs = [ov.Tensor(np.array([ids], dtype=np.int64)) for ids, _ in reqs]
        configs = []
        for _, n in reqs:
            cfg = ov_genai.GenerationConfig()
            cfg.max_new_tokens = cfg.min_new_tokens = n
            cfg.ignore_eos, cfg.do_sample = True, False
            configs.append(cfg)
        return [list(r.m_generation_ids[0]) for r in pipe.generate(inputs, configs)]

    generate(spec["warmup"])
    t0 = time.perf_counter()
    outputs = generate(spec["requests"])
    wall = time.perf_counter() - t0
    core = ov.Core()
    props = {}
    for name in ("INFERENCE_PRECISION_HINT", "KV_CACHE_PRECISION", "INFERENCE_NUM_THREADS"):
        try:
            props[name] = str(core.get_property("CPU", name))
        except RuntimeError:
            props[name] = "n/a"
    print(json.dumps({"wall_s": wall, "load_s": load_s, "outputs": outputs,
                      "openvino": ov.__version__, "openvino_genai": ov_genai.__version__,
                      "cpu_properties": props, "scheduler": str(sched.to_string())
                      if hasattr(sched, "to_string") else ""}))
    return 0


def peer_dir() -> Path:
    from kvray.models.default_model import cache_dir

    return cache_dir() / "peer"


def run_openvino(requests: list[Request], warmup: list[Request], weights: str,
                 max_num_seqs: int, max_num_batched_tokens: int) -> RunResult:
    """OpenVINO GenAI on the workload, in its venv (set up by peer_openvino.sh if needed)."""
    setup = subprocess.run([str(REPO_ROOT / "benchmarks" / "peer_openvino.sh"), weights],
                           capture_output=True, text=True)
    if setup.returncode != 0:
        raise RuntimeError(f"benchmarks/peer_openvino.sh failed:\n{setup.stderr[-2000:]}")
    model_dir = setup.stdout.strip().splitlines()[-1]
    python = peer_dir() / "openvino-venv" / "bin" / "python"
    spec = {"model_dir": model_dir, "cache_gb": 2, "max_num_seqs": max_num_seqs,
            "max_num_batched_tokens": max_num_batched_tokens,
            "warmup": [[r.prompt_ids, r.output_len] for r in warmup],
            "requests": [[r.prompt_ids, r.output_len] for r in requests]}
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump(spec, f)
        f.flush()
        proc = subprocess.run([str(python), str(Path(__file__).resolve()),
                               "--openvino-driver", f.name], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"the OpenVINO driver failed:\n{proc.stderr[-3000:]}")
    data = json.loads(proc.stdout.strip().splitlines()[-1])
    outputs = data.pop("outputs")
    useful = sum(min(len(o), r.output_len) for o, r in zip(outputs, requests, strict=True))
    wrong = sum(len(o) != r.output_len for o, r in zip(outputs, requests, strict=True))
    print(f"  OpenVINO {data['openvino_genai']}: model {model_dir}, CPU properties "
          f"{data['cpu_properties']}, load {data['load_s']:.1f} s", flush=True)
    return RunResult(f"OpenVINO GenAI CB ({weights} weights)", data["wall_s"], len(requests),
                     sum(len(r.prompt_ids) for r in requests), useful,
                     {**data, "model_dir": model_dir, "wrong_lengths": wrong,
                      "outputs": outputs})


def kvray_variant(name: str) -> dict[str, Any] | str:
    """Engine keys of one kvray variant, or why it cannot run here."""
    from kvray.config import FIELD_SECTION
    from kvray.models.default_model import (
        DEFAULT_MODEL_NAME,
        default_gguf_path,
        default_model_dir,
    )

    if name == "default":
        return {}
    if name == "dense":  # the built-in model's Hugging Face weights, not quantized
        return {"model": str(default_model_dir())}
    if name == "int8":
        if "quantization" not in FIELD_SECTION:
            return "config key quantization not in this kvray yet"
        return {"model": str(default_model_dir()), "quantization": "int8"}
    if name == "Q4_1":
        return {"model": str(default_gguf_path())}
    if name in ("Q8_0", "Q4_K_M"):
        path = peer_dir() / f"{DEFAULT_MODEL_NAME}.{name}.gguf"
        if not path.is_file():
            return f"{path} not found (benchmarks/peer_llamacpp.sh --kld makes it)"
        return {"model": str(path)}
    return f"unknown variant {name!r} (int8, Q8_0, Q4_K_M, Q4_1, dense, default)"


def split_variant(spec: str) -> tuple[str, str | None]:
    """``int8+kvint8`` -> (``int8``, ``int8``): a variant with its own kv_cache_dtype."""
    name, _, kv = spec.partition("+kv")
    return name, kv or None


def run_peer(args: argparse.Namespace, requests: list[Request], warmup: list[Request],
             dtype: str, config: dict[str, Any]) -> int:
    """kvray in each variant, then OpenVINO, on the same requests, ``--rounds`` times in
    turn (the machines are shared: a round's systems run back to back, and each ratio is
    taken within its round); the table with the median round's numbers and the ratios."""
    classes = import_kvray()
    if isinstance(classes, str):
        raise SystemExit(f"kvray cannot be imported: {classes}")
    rounds: list[dict[str, RunResult]] = []
    skipped: dict[str, str] = {}
    for r in range(args.rounds):
        results: dict[str, RunResult] = {}
        for spec in [v for v in args.kvray_variants.split(",") if v]:
            name, kv = split_variant(spec)
            keys = kvray_variant(name)
            if isinstance(keys, str):
                skipped[spec] = keys
                print(f"kvray {spec}: skipped ({keys})", flush=True)
                continue
            if kv or args.kv_cache_dtype:
                keys["kv_cache_dtype"] = kv or args.kv_cache_dtype
            print(f"round {r + 1}/{args.rounds}: running kvray {spec} {keys} ...", flush=True)
            res = run_kvray(classes, requests, warmup, {**engine_kwargs(args), **keys}, dtype)
            res.system = f"kvray {spec} ({dtype} activations)"
            res.extra["keys"] = keys
            results[f"kvray {spec}"] = res
        print(f"round {r + 1}/{args.rounds}: running OpenVINO GenAI ...", flush=True)
        results["openvino"] = run_openvino(requests, warmup, args.openvino_weights,
                                           args.max_num_seqs or 256,
                                           args.max_num_batched_tokens or 2048)
        rounds.append(results)
    median = {key: sorted((rd[key] for rd in rounds), key=lambda x: x.output_tok_per_s)[
        len(rounds) // 2] for key in rounds[0]}
    ov_run = median["openvino"]
    rows = [["system (median round)", "requests/s", "output tok/s", "total tok/s", "wall s"]]
    rows += [result_row(r) for r in median.values()]
    ratios: dict[str, list[float]] = {}
    for key in median:
        if key == "openvino":
            continue
        ratios[key] = sorted(rd[key].output_tok_per_s / rd["openvino"].output_tok_per_s
                             for rd in rounds)
        mid = ratios[key][len(rounds) // 2]
        mark = "met" if mid >= TARGET_PEER_SPEEDUP else "NOT met"
        rows.append([f"ratio {key} / OpenVINO (target >= {TARGET_PEER_SPEEDUP:g}x: {mark})",
                     "", f"{mid:.3g}x (rounds {ratios[key][0]:.3g}-{ratios[key][-1]:.3g}x)",
                     "", ""])
    print()
    print(f"workload: {args.workload}, {len(requests)} requests, "
          f"{config['prompt_tokens']} prompt / {config['output_tokens']} output tokens "
          f"(greedy, ignore_eos); {args.rounds} round(s), each system once per round")
    print(f"OpenVINO CPU properties: {ov_run.extra['cpu_properties']} (its KV cache "
          "precision is its CPU default unless listed otherwise)")
    print(format_table(rows))
    for name, why in skipped.items():
        print(f"kvray {name}: not run ({why})")
    for key, r in median.items():
        if key != "openvino":
            same = greedy_agreement(r.extra["outputs"], ov_run.extra["outputs"])
            print(f"greedy agreement (informational) {key} vs OpenVINO: first 8 tokens "
                  f"identical in {same}/{len(requests)} requests")
    if args.json:
        runs = []
        for rd in rounds:
            runs.append({})
            for name, r in rd.items():
                d = r.to_dict()
                d["extra"] = {k: v for k, v in d["extra"].items() if k != "outputs"}
                runs[-1][name] = d
        data = {"config": config, "rounds": runs, "ratios": ratios, "skipped": skipped,
                "target_speedup_vs_openvino": TARGET_PEER_SPEEDUP}
        args.json.write_text(json.dumps(data, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-requests", type=int, default=None,
                   help="default 128; 48 with --peer")
    p.add_argument("--workload", choices=["uniform", "chat", "prefix"], default=None,
                   help="uniform lengths (the default); chat: log-normal lengths (the default "
                   "with --peer); prefix: 90%% of every prompt is one shared system prompt")
    p.add_argument("--peer", choices=["openvino"], default=None,
                   help="compare with OpenVINO GenAI's continuous batching instead of "
                   "transformers (see the module docstring)")
    p.add_argument("--kvray-variants", default="int8,int8+kvint8,Q8_0",
                   help="with --peer: kvray runs, comma-separated (default: int8, int8 "
                   "with an int8 KV cache like OpenVINO's u8 CPU default, Q8_0): int8 (HF "
                   "checkpoint, "
                   "quantization int8), Q8_0 / Q4_K_M (GGUFs made by peer_llamacpp.sh --kld), "
                   "Q4_1 (the shipped GGUF), dense (its Hugging Face weights, not "
                   "quantized), default (the engine's defaults); +kv<dtype> gives one its "
                   "kv_cache_dtype (int8+kvint8)")
    p.add_argument("--kv-cache-dtype", default=None,
                   help="with --peer: kvray's kv_cache_dtype (default: the engine's); a "
                   "variant's own as int8+kvint8")
    p.add_argument("--rounds", type=int, default=1,
                   help="with --peer: run every system this many times, in turn")
    p.add_argument("--openvino-weights", default="int8",
                   help="with --peer openvino: optimum-cli's --weight-format (default int8)")
    p.add_argument("--openvino-driver", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--min-prompt", type=int, default=16)
    p.add_argument("--max-prompt", type=int, default=512)
    p.add_argument("--min-output", type=int, default=16)
    p.add_argument("--max-output", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=32, help="baseline static batch size")
    p.add_argument("--skip-baseline", action="store_true")
    p.add_argument("--skip-kvray", action="store_true")
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="kvray max_num_seqs (default: the engine's)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="kvray max_num_batched_tokens (default: the engine's)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch.set_num_threads (default: leave torch's default)")
    p.add_argument("--dtype", choices=["auto", "bfloat16", "float16", "float32"],
                   default="auto", help="dtype of both systems (default auto: kvray's choice "
                   "for this CPU, bf16 only where it is native)")
    p.add_argument("--json", type=Path, default=None, help="write the numbers to this file")
    args = p.parse_args(argv)
    if args.num_requests is None:
        args.num_requests = 48 if args.peer else 128
    if args.workload is None:
        args.workload = "chat" if args.peer else "uniform"
    return args


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The kvray engine knobs given on the command line (others keep engine defaults)."""
    kw = {"max_num_seqs": args.max_num_seqs,
          "max_num_batched_tokens": args.max_num_batched_tokens}
    return {k: v for k, v in kw.items() if v is not None}


def describe_config(args: argparse.Namespace, model_dir: Path, requests: list[Request],
                    dtype: str, dtype_reason: str) -> dict[str, Any]:
    """The configuration and workload summary printed and written to JSON."""
    from kvray.hardware import describe

    return {
        "model_dir": str(model_dir), "hardware": describe(), "dtype": dtype,
        "dtype_reason": dtype_reason, "num_requests": len(requests),
        "workload": args.workload, "seed": args.seed,
        "prompt_len_range": [args.min_prompt, args.max_prompt],
        "output_len_range": [args.min_output, args.max_output],
        "prompt_tokens": sum(len(r.prompt_ids) for r in requests),
        "output_tokens": sum(r.output_len for r in requests),
        "baseline_batch_size": args.batch_size,
        "kvray_engine_kwargs": {"enable_prefix_caching": True, **engine_kwargs(args)},
        "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
        "python": platform.python_version(), "machine": platform.machine(),
        "cpu_count": os.cpu_count(), "load_avg_1m_at_start": round(os.getloadavg()[0], 2),
    }


def use_repo_checkout() -> None:
    """Import kvray from this checkout, even if the installed (editable) copy is stale."""
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))


def main(argv: list[str] | None = None) -> int:
    if argv is None and "--openvino-driver" in sys.argv:  # in OpenVINO's venv: no kvray
        return openvino_driver(Path(sys.argv[sys.argv.index("--openvino-driver") + 1]))
    use_repo_checkout()
    from kvray.hardware import machine_dtype
    from kvray.models.default_model import default_model_dir
    from kvray.models.loader import checkpoint_dtype

    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model_dir = default_model_dir()
    cfg = model_config(model_dir)
    requests = make_workload(args.num_requests, args.seed, cfg["vocab_size"],
                             (args.min_prompt, args.max_prompt),
                             (args.min_output, args.max_output), args.workload)
    warmup = warmup_workload(cfg["vocab_size"], args.seed)
    dtype, why = machine_dtype(args.dtype, "cpu", checkpoint_dtype(model_dir))
    config = describe_config(args, model_dir, requests, dtype, why)
    print("config:")
    for k, v in config.items():
        print(f"  {k}: {v}")
    print(f"torch threads: {torch.get_num_threads()}", flush=True)
    if args.peer:
        return run_peer(args, requests, warmup, dtype, config)

    peak = matmul_peak_flops(getattr(torch, dtype))
    print(f"{dtype} matmul peak: {peak / 1e9:.1f} GFLOP/s", flush=True)

    results: dict[str, RunResult] = {}
    kvray_error: str | None = None
    if not args.skip_kvray:
        classes = import_kvray()
        if isinstance(classes, str):
            kvray_error = classes
            print(f"kvray skipped: `from kvray import LLM, SamplingParams` failed ({classes})",
                  flush=True)
        else:
            print("running kvray ...", flush=True)
            results["kvray"] = run_kvray(classes, requests, warmup, engine_kwargs(args), dtype)
    if not args.skip_baseline:
        print("running transformers static batching ...", flush=True)
        results["baseline"] = run_baseline(model_dir, requests, warmup, args.batch_size,
                                           dtype)

    ordered = {k: results[k] for k in ("baseline", "kvray") if k in results}
    eff = decode_efficiency(ordered["kvray"], cfg, peak) if "kvray" in ordered else {}
    report(ordered, eff, peak, dtype)
    if args.json:
        write_json(args.json, config, ordered, eff, peak, kvray_error)
    return 0


if __name__ == "__main__":
    sys.exit(main())
