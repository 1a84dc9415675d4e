"""Quality of kvray's weight and KV cache formats on the built-in model: perplexity and KL
divergence against the unquantized model, and greedy agreement.

For each format (a checkpoint file plus the engine keys ``quantization``, ``kv_cache_dtype``
and ``dtype``) this runs two measurements:

- **Teacher-forced** over ``benchmarks/data/quality_text.txt`` (an English text written for
  the project, ~2,860 tokens): the text is cut into windows of ``--ctx`` tokens and, as
  llama.cpp's ``llama-perplexity`` does (so that its ``--kl-divergence`` numbers compare,
  see ``benchmarks/peer_llamacpp.sh --kld``), only the second half of each window is
  scored, every scored token seeing at least ``ctx / 2`` tokens of context. Per format:
  perplexity, the mean per-token KL divergence KL(reference || format) over the full
  vocabulary, and how often both put the same token on top. The model runs through
  kvray's own :class:`~kvray.actors.model_runner.ModelRunner` (its loader, kernel plan and
  paged KV cache in the format's ``kv_cache_dtype``): ``prefill`` scores each window as one
  prefill row (the compute-bound kernels); ``decode`` prefills the first half and then feeds
  the scored tokens one decode step at a time (the batch-1 kernels that generate tokens).
  Both read K/V back from the paged cache, so a quantized cache counts in both.
- **Greedy agreement** through :class:`kvray.LLM`: a dozen everyday chat prompts, 48 greedy
  tokens each (EOS ignored); per format the mean length of the prefix identical to the
  reference's, how many of the 12 agree over all 48 tokens, and for the ones that diverge
  the reference's top-1 / top-2 log-probability margin at the divergence (a divergence at
  a margin under 0.1 nat is a near-tie, where any rounding may flip the choice).

The reference of a format is the same weights unquantized in float32: the built-in Q4_1
GGUF dequantized (``quantization: none``) for the GGUF formats (Q8_0 / Q4_K_M are made
by ``llama-quantize`` from an f32 GGUF of exactly those weights: run
``benchmarks/peer_llamacpp.sh --kld`` first; missing files are listed as skipped), and the
bf16 Hugging Face directory in float32 for online ``int8``; a reference's own ``decode``
row is scored against its ``prefill`` (the float32 kernels' path-to-path noise). Formats
whose config keys this kvray does not have yet, or that its config refuses on this machine,
are listed with the reason instead of a number. All formats: ~10 minutes on a 2-core EPYC.

Usage:
    python benchmarks/quality.py [--formats fp32,Q4_1,Q8_0,Q4_K_M,int8,kv-int8,kv-fp8,
        kv-fp8_e5m2] [--ctx 512] [--paths prefill,decode] [--skip-greedy] [--skip-ppl]
        [--dtype auto] [--gguf-dir DIR] [--llamacpp-kld PATH] [--json PATH]
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
TEXT_PATH = REPO_ROOT / "benchmarks" / "data" / "quality_text.txt"
GREEDY_TOKENS = 48
NEAR_TIE_NATS = 0.1
KLD_TARGET = 1.10  # kvray's KLD <= llama.cpp's + 10 % on the same GGUF and text
MiB = 2**20

PROMPTS = [
    "What is a good way to keep bread fresh for a few days?",
    "Give me three tips for sleeping better.",
    "How do I boil an egg so the yolk stays soft?",
    "Why is the sky blue? Answer in two sentences.",
    "Write a short, friendly message inviting a neighbour to dinner on Saturday.",
    "What should I pack for a one-day hike in the mountains?",
    "Explain what a budget is to a teenager.",
    "How often should I water a cactus?",
    "What are some easy ways to save energy at home?",
    "Suggest a simple vegetarian meal I can cook in twenty minutes.",
    "How can I remember people's names better?",
    "What is the difference between weather and climate?",
]


@dataclass
class Format:
    """One way to run the built-in model: a checkpoint and the engine keys for it."""

    name: str
    model: Path
    keys: dict[str, Any]  # engine keys besides model (quantization, kv_cache_dtype, dtype)
    reference: str  # the name of the format it is compared against ("" for a reference)
    what: str  # one line for the table
    needs: tuple[str, ...] = ()  # config keys it cannot run without
    llamacpp: str | None = None  # the llama.cpp format name its KLD compares with


@dataclass
class Result:
    """All numbers of one format (None where not measured)."""

    name: str
    what: str
    model: str
    keys: dict[str, Any]
    reference: str
    skipped: str = ""
    file_mib: float | None = None
    weight_mib: float | None = None  # parameters and buffers of the loaded model
    kv_bytes_per_token: float | None = None  # all layers, K and V
    load_s: float | None = None
    ppl: dict[str, float] = field(default_factory=dict)  # per path
    kld: dict[str, float] = field(default_factory=dict)
    kld_p99: dict[str, float] = field(default_factory=dict)
    same_top: dict[str, float] = field(default_factory=dict)
    score_s: dict[str, float] = field(default_factory=dict)
    greedy_prefix: list[int] | None = None
    greedy_margins: list[float] | None = None  # reference margin at each divergence
    greedy_s: float | None = None
    llamacpp_kld: float | None = None


# --------------------------------------------------------------------------- formats


def kvray_keys() -> set[str]:
    """The config keys this kvray knows (``quantization`` / ``kv_cache_dtype`` land later)."""
    from kvray.config import FIELD_SECTION

    return set(FIELD_SECTION)


def build_formats(names: list[str], gguf_dir: Path, dtype: str) -> dict[str, Format]:
    """The requested formats and the references they need, references first."""
    from kvray.models.default_model import (
        DEFAULT_MODEL_NAME,
        default_gguf_path,
        default_model_dir,
    )

    shipped = default_gguf_path()
    none = {"quantization": "none"}
    ref32 = {"dtype": "float32", **none}
    every = {
        "fp32": Format("fp32", shipped, ref32, "", "Q4_1 GGUF dequantized, float32 (reference)",
                       needs=()),
        "fp32-hf": Format("fp32-hf", default_model_dir(), {"dtype": "float32"}, "",
                          "HF directory (bf16 weights), float32 (reference of int8)"),
        "Q4_1": Format("Q4_1", shipped, {"dtype": dtype}, "fp32",
                       f"Q4_1 GGUF as shipped (quantization null), dtype {dtype}",
                       llamacpp="Q4_1"),
        "Q8_0": Format("Q8_0", gguf_dir / f"{DEFAULT_MODEL_NAME}.Q8_0.gguf", {"dtype": dtype},
                       "fp32", f"Q8_0 GGUF from llama-quantize, dtype {dtype}",
                       llamacpp="Q8_0"),
        "Q4_K_M": Format("Q4_K_M", gguf_dir / f"{DEFAULT_MODEL_NAME}.Q4_K_M.gguf",
                         {"dtype": dtype}, "fp32",
                         f"Q4_K_M GGUF from llama-quantize, dtype {dtype}", llamacpp="Q4_K_M"),
        "int8": Format("int8", default_model_dir(), {"dtype": dtype, "quantization": "int8"},
                       "fp32-hf", f"HF directory, online int8 weights, dtype {dtype}",
                       needs=("quantization",)),
    }
    for kv in ("int8", "fp8", "fp8_e4m3", "fp8_e5m2"):
        every[f"kv-{kv}"] = Format(f"kv-{kv}", shipped, {**ref32, "kv_cache_dtype": kv},
                                   "fp32", f"fp32 weights, kv_cache_dtype {kv}",
                                   needs=("kv_cache_dtype",))
    unknown = [n for n in names if n not in every]
    if unknown:
        raise SystemExit(f"unknown format(s) {unknown}; known: {', '.join(every)}")
    chosen: dict[str, Format] = {}
    for name in names:  # a format's reference runs before it
        ref = every[name].reference
        if ref and ref not in chosen:
            chosen[ref] = every[ref]
        chosen.setdefault(name, every[name])
    return dict(sorted(chosen.items(), key=lambda kv: kv[1].reference != ""))


def engine_keys(fmt: Format, known: set[str]) -> dict[str, Any] | str:
    """The format's keys this kvray accepts, or why the format cannot run here. A key that
    only restates today's behaviour (``quantization: none`` on a kvray that always
    dequantizes) is dropped; one the format is about (``needs``) makes it skip."""
    missing = [k for k in fmt.needs if k not in known]
    if missing:
        return f"config key {', '.join(missing)} not in this kvray yet"
    if not fmt.model.exists():
        return f"{fmt.model} not found (made by benchmarks/peer_llamacpp.sh --kld)"
    return {k: v for k, v in fmt.keys.items() if k in known}


# --------------------------------------------------------------------------- teacher forcing


def text_tokens(tokenizer: Any) -> list[int]:
    """The quality text as token ids, without special tokens (the GGUF adds no BOS)."""
    return tokenizer(TEXT_PATH.read_text(), add_special_tokens=False)["input_ids"]


def windows(tokens: list[int], ctx: int) -> list[list[int]]:
    """Consecutive windows of ``ctx`` tokens (the tail that fills no window is dropped, as
    llama-perplexity drops it)."""
    return [tokens[i:i + ctx] for i in range(0, len(tokens) - ctx + 1, ctx)]


class Scorer:
    """kvray's model runner on one format, with a paged cache just big enough for a window."""

    def __init__(self, model: Path, keys: dict[str, Any], ctx: int) -> None:
        from kvray.actors.model_runner import ModelRunner
        from kvray.config import config_from_flat
        from kvray.parallel import ParallelContext

        config = config_from_flat({"model": str(model), "max_model_len": ctx, **keys})
        self.runner = ModelRunner(config, str(model), ParallelContext(), torch.device("cpu"))
        self.block_size = config.cache.block_size
        self.blocks = list(range(-(-ctx // self.block_size)))
        self.runner.initialize_cache(len(self.blocks))

    def weight_bytes(self) -> int:
        """Bytes of the loaded weights: parameters, buffers and the quantized matrices the
        layers hold beside them (a C++ kernel's blob, a QuantTensor); shared ones once."""
        seen: set[tuple[int, int]] = set()
        quants: set[int] = set()
        total = 0

        def add(t: torch.Tensor) -> None:
            nonlocal total
            key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
            if key not in seen:
                seen.add(key)
                total += key[1]

        model = self.runner.model
        for t in list(model.parameters()) + list(model.buffers()):
            add(t)
        for m in model.modules():
            blob = getattr(m, "qweight", None)
            if isinstance(blob, torch.Tensor):
                add(blob)
            quant = getattr(m, "quant", None)
            if quant is not None and id(quant) not in quants:
                quants.add(id(quant))
                total += int(quant.nbytes)
        return total

    def kv_bytes_per_token(self) -> float:
        caches = [c for c in self.runner.cache.kv_caches if c is not None]
        tokens = caches[0].shape[2] * caches[0].shape[3]
        return sum(c.nbytes for c in caches) / tokens

    def _run(self, toks: list[int], first: int) -> torch.Tensor:
        """Hidden states of ``toks`` at positions ``first``.. (their K/V go into the cache)."""
        from kvray.kernels.attention import paged_batch

        def to_tensor(data: list) -> torch.Tensor:
            return torch.tensor(data, dtype=torch.int64)

        ids, meta, _ = paged_batch([(toks, first, self.blocks)], self.block_size, to_tensor,
                                   **self.runner.kernels)
        return self.runner.model(to_tensor(ids), meta, None, None,
                                 kv_caches=self.runner.cache.kv_caches)

    @torch.inference_mode()
    def log_probs(self, window: list[int], path: str) -> torch.Tensor:
        """float32 log-probabilities over the vocabulary at positions ctx/2 .. ctx-2 (the
        predictions of tokens ctx/2+1 .. ctx-1)."""
        first = len(window) // 2
        if path == "prefill":
            hidden = self._run(window, 0)[first:len(window) - 1]
        else:  # the first half as one prefill, then one decode step per scored position
            self._run(window[:first], 0)
            hidden = torch.cat([self._run([window[p]], p) for p in range(first, len(window) - 1)])
        logits = self.runner.model.compute_logits(hidden)
        return torch.log_softmax(logits.float(), dim=-1)

    def release(self) -> None:
        self.runner.release()


def compare(logp: torch.Tensor, ref: torch.Tensor, targets: torch.Tensor) -> dict[str, Any]:
    """Per-token NLL of ``targets`` and KL(ref || logp) per position, and same-argmax flags."""
    nll = -logp.gather(1, targets[:, None])[:, 0]
    kld = (ref.exp() * (ref - logp)).sum(-1).clamp_min(0.0)
    same = logp.argmax(-1) == ref.argmax(-1)
    return {"nll": nll.double(), "kld": kld.double(), "same": same}


def summarize_scores(parts: list[dict[str, Any]]) -> tuple[float, float, float, float]:
    """(perplexity, mean KLD, 99th percentile KLD, same-top fraction) over all windows."""
    nll = torch.cat([p["nll"] for p in parts])
    kld = torch.cat([p["kld"] for p in parts])
    same = torch.cat([p["same"] for p in parts])
    return (math.exp(nll.mean().item()), kld.mean().item(),
            torch.quantile(kld, 0.99).item(), same.double().mean().item())


# --------------------------------------------------------------------------- greedy


def greedy(model: Path, keys: dict[str, Any], want_margins: bool
           ) -> tuple[list[list[int]], list[list[float]], float]:
    """The 48 greedy tokens of each prompt through :class:`kvray.LLM` (chat template), and
    with ``want_margins`` the top-1 minus top-2 log-probability at each position."""
    from kvray import LLM, SamplingParams

    llm = LLM(model=str(model), max_model_len=1024, kv_cache_memory=256 * MiB, **keys)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=GREEDY_TOKENS, ignore_eos=True,
                                logprobs=2 if want_margins else None)
        start = time.perf_counter()
        outs = llm.chat([[{"role": "user", "content": p}] for p in PROMPTS], params,
                        use_tqdm=False)
        wall = time.perf_counter() - start
    finally:
        llm.shutdown()
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    margins: list[list[float]] = []
    for o in outs:
        rows = o.outputs[0].logprobs or []
        top = [sorted(entry.values(), reverse=True) for entry in rows]
        margins.append([t[0] - t[1] if len(t) > 1 else math.inf for t in top])
    return tokens, margins, wall


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


# --------------------------------------------------------------------------- one format


def measure(fmt: Format, keys: dict[str, Any], res: Result, args: argparse.Namespace,
            wins: list[list[int]], refs: dict[str, list[torch.Tensor]],
            ref_greedy: dict[str, tuple[list[list[int]], list[list[float]]]]) -> None:
    """Fill ``res`` for ``fmt``; a reference keeps its log-probs / tokens in ``refs`` /
    ``ref_greedy`` for the formats compared with it."""
    is_ref = fmt.reference == ""
    if not args.skip_ppl or is_ref:
        t0 = time.perf_counter()
        scorer = Scorer(fmt.model, keys, args.ctx)
        res.load_s = time.perf_counter() - t0
        res.weight_mib = scorer.weight_bytes() / MiB
        res.kv_bytes_per_token = scorer.kv_bytes_per_token()
        try:
            # a reference scores prefill first (the log-probs the others are compared with),
            # then its other paths against that: the kernels' path-to-path noise in float32
            paths = ["prefill"] + [p for p in args.paths if p != "prefill"] if is_ref \
                else args.paths
            for path in paths:
                t0 = time.perf_counter()
                parts, kept = [], []
                for w in wins:
                    logp = scorer.log_probs(w, path)
                    targets = torch.tensor(w[len(w) // 2 + 1:])
                    ref = logp if is_ref and path == "prefill" else \
                        refs[fmt.reference or fmt.name][len(kept)]
                    parts.append(compare(logp, ref, targets))
                    kept.append(logp)
                res.score_s[path] = time.perf_counter() - t0
                (res.ppl[path], res.kld[path], res.kld_p99[path],
                 res.same_top[path]) = summarize_scores(parts)
                if is_ref and path == "prefill":
                    refs[fmt.name] = kept
                del kept
                print(f"  {fmt.name} {path}: ppl {res.ppl[path]:.4f}, KLD {res.kld[path]:.6f}, "
                      f"same top {100 * res.same_top[path]:.2f}% "
                      f"({res.score_s[path]:.1f} s)", flush=True)
        finally:
            scorer.release()
            del scorer
            gc.collect()
    if not args.skip_greedy:
        tokens, margins, wall = greedy(fmt.model, keys, want_margins=is_ref)
        res.greedy_s = wall
        if is_ref:
            ref_greedy[fmt.name] = (tokens, margins)
        ref_tokens, ref_margins = ref_greedy[fmt.reference or fmt.name]
        res.greedy_prefix = [common_prefix(a, b) for a, b in zip(tokens, ref_tokens, strict=True)]
        res.greedy_margins = [m[n] for n, m in zip(res.greedy_prefix, ref_margins, strict=True)
                              if n < GREEDY_TOKENS and n < len(m)]
        print(f"  {fmt.name} greedy: identical prefix {res.greedy_prefix} "
              f"({wall:.1f} s)", flush=True)


# --------------------------------------------------------------------------- report


def format_table(rows: list[list[str]]) -> str:
    """An aligned markdown table; the first row is the header."""
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    lines = ["| " + " | ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True))
             + " |"
             for r in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def report(results: list[Result], paths: list[str]) -> None:
    """The formats table and the quality table."""
    rows = [["format", "what", "file MiB", "weights in memory MiB", "KV bytes/token",
             "load s"]]
    for r in results:
        rows.append([r.name, r.what if not r.skipped else f"{r.what} - SKIPPED: {r.skipped}",
                     _num(r.file_mib, ".1f"), _num(r.weight_mib, ".1f"),
                     _num(r.kv_bytes_per_token, ".0f"), _num(r.load_s, ".1f")])
    print(format_table(rows))
    print()
    head = ["format", "vs"]
    for p in paths:
        head += [f"PPL {p}", f"mean KLD {p}", f"p99 KLD {p}", f"same top % {p}"]
    head += ["llama.cpp KLD", "kvray / llama.cpp", "greedy prefix (of 48)", "all 48 same",
             "near-tie divergences"]
    rows = [head]
    for r in results:
        if r.skipped:
            continue
        row = [r.name, r.reference or "-"]
        for p in paths:
            row += [_num(r.ppl.get(p), ".4f"), _num(r.kld.get(p), ".6f"),
                    _num(r.kld_p99.get(p), ".5f"),
                    _num(None if p not in r.same_top else 100 * r.same_top[p], ".2f")]
        ours = max(r.kld.values()) if r.kld else None  # the worse of the paths measured
        ratio = "-"
        if r.llamacpp_kld is not None and ours is not None and r.llamacpp_kld > 0:
            q = ours / r.llamacpp_kld
            ratio = f"{q:.2f}x ({'met' if q <= KLD_TARGET else 'NOT met'}, <= {KLD_TARGET:g}x)"
        row += [_num(r.llamacpp_kld, ".6f"), ratio]
        if r.greedy_prefix is not None:
            full = sum(n == GREEDY_TOKENS for n in r.greedy_prefix)
            ties = sum(m < NEAR_TIE_NATS for m in r.greedy_margins or [])
            diverged = len(r.greedy_prefix) - full
            row += [f"{statistics.mean(r.greedy_prefix):.1f}", f"{full}/{len(r.greedy_prefix)}",
                    f"{ties}/{diverged}" if diverged else "-"]
        else:
            row += ["-", "-", "-"]
        rows.append(row)
    print(format_table(rows))
    print(f"\nKLD: mean per-token KL(reference || format) in nats over the full vocabulary; "
          f"p99: its 99th percentile. near-tie: the reference's top-1/top-2 margin at the "
          f"first differing token < {NEAR_TIE_NATS} nat. kvray / llama.cpp compares the "
          "larger of kvray's KLDs (prefill, decode) with llama-perplexity --kl-divergence "
          "on the same file and text (llama.cpp stores its base log-probs in 16 bits: its "
          "KLD of the f32 file against itself, listed by peer_llamacpp.sh --kld, is its floor).")


def load_llamacpp_kld(path: Path | None, ctx: int) -> dict[str, float]:
    """llama.cpp's mean KLD per format from ``peer_llamacpp.sh --kld`` (empty if absent)."""
    if path is None or not path.is_file():
        return {}
    data = json.loads(path.read_text())
    if data.get("ctx") != ctx:
        print(f"note: {path} was measured with -c {data.get('ctx')}, this run uses --ctx {ctx}: "
              "its KLD is not compared", flush=True)
        return {}
    return {k: v["mean_kld"] for k, v in data.get("formats", {}).items()
            if v.get("mean_kld") is not None}


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from kvray.models.default_model import cache_dir

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--formats", default="fp32,Q4_1,Q8_0,Q4_K_M,int8,kv-int8,kv-fp8,kv-fp8_e5m2",
                   help="comma-separated: fp32, Q4_1, Q8_0, Q4_K_M, int8, kv-int8, kv-fp8, "
                   "kv-fp8_e4m3, kv-fp8_e5m2 (references are added as needed)")
    p.add_argument("--ctx", type=int, default=512,
                   help="window length in tokens (llama-perplexity's -c); the second half of "
                   "each window is scored")
    p.add_argument("--paths", default="prefill,decode",
                   help="teacher-forced paths: prefill and/or decode (the reference always "
                   "runs prefill, in float32)")
    p.add_argument("--dtype", choices=["auto", "bfloat16", "float16", "float32"],
                   default="auto", help="activation dtype of the quantized weight formats "
                   "(default auto: what kvray runs on this CPU)")
    p.add_argument("--gguf-dir", type=Path, default=cache_dir() / "peer",
                   help="where peer_llamacpp.sh --kld leaves the Q8_0 / Q4_K_M GGUFs")
    p.add_argument("--llamacpp-kld", type=Path, default=None,
                   help="llama.cpp's KLDs (peer_llamacpp.sh --kld writes "
                   "<gguf-dir>/llamacpp_kld.json, the default)")
    p.add_argument("--skip-greedy", action="store_true")
    p.add_argument("--skip-ppl", action="store_true",
                   help="greedy agreement only (references still run their teacher-forced "
                   "pass, which is quick)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument("--json", type=Path, default=None, help="write the numbers to this file")
    args = p.parse_args(argv)
    args.paths = [x for x in args.paths.split(",") if x]
    if not args.paths or set(args.paths) - {"prefill", "decode"}:
        p.error("--paths: prefill and/or decode")
    if args.ctx < 8 or args.ctx % 2:
        p.error("--ctx: an even number >= 8")
    return args


def main(argv: list[str] | None = None) -> int:
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    from kvray.hardware import describe
    from kvray.models.default_model import default_gguf_path
    from kvray.tokenizer import load_tokenizer

    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    formats = build_formats([f for f in args.formats.split(",") if f], args.gguf_dir,
                            args.dtype)
    known = kvray_keys()
    tokenizer = load_tokenizer(default_gguf_path())
    tokens = text_tokens(tokenizer)
    wins = windows(tokens, args.ctx)
    if not wins:
        raise SystemExit(f"the text has {len(tokens)} tokens, fewer than one window of "
                         f"{args.ctx}")
    scored = len(wins) * (args.ctx - 1 - args.ctx // 2)
    print(describe())
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; python "
          f"{platform.python_version()}; load avg {os.getloadavg()[0]:.2f}")
    print(f"text: {TEXT_PATH.name}, {len(tokens)} tokens -> {len(wins)} windows of {args.ctx}, "
          f"{scored} scored tokens; greedy: {len(PROMPTS)} prompts x {GREEDY_TOKENS} tokens")
    print(f"config keys present: quantization={'quantization' in known}, "
          f"kv_cache_dtype={'kv_cache_dtype' in known}", flush=True)
    kld_path = args.llamacpp_kld or args.gguf_dir / "llamacpp_kld.json"
    llamacpp = load_llamacpp_kld(kld_path, args.ctx)

    refs: dict[str, list[torch.Tensor]] = {}
    ref_greedy: dict[str, tuple[list[list[int]], list[list[float]]]] = {}
    results: list[Result] = []
    for fmt in formats.values():
        res = Result(fmt.name, fmt.what, str(fmt.model), dict(fmt.keys), fmt.reference)
        results.append(res)
        keys = engine_keys(fmt, known)
        if isinstance(keys, str):
            res.skipped = keys
        elif fmt.reference and fmt.reference not in refs and \
                fmt.reference not in ref_greedy:
            res.skipped = f"its reference {fmt.reference} did not run"
        if res.skipped:
            print(f"{fmt.name}: skipped ({res.skipped})", flush=True)
            continue
        res.keys = keys
        res.file_mib = fmt.model.stat().st_size / MiB if fmt.model.is_file() else \
            sum(f.stat().st_size for f in fmt.model.glob("*.safetensors")) / MiB
        res.llamacpp_kld = llamacpp.get(fmt.llamacpp) if fmt.llamacpp else None
        print(f"{fmt.name}: {fmt.what}; keys {keys}", flush=True)
        try:
            measure(fmt, keys, res, args, wins, refs, ref_greedy)
        except Exception as err:  # a config refusal is a result: say which and go on
            res.skipped = f"{type(err).__name__}: {err}".splitlines()[0][:300]
            print(f"{fmt.name}: failed ({res.skipped})", flush=True)
    print()
    report(results, args.paths)
    if args.json:
        data = {"hardware": describe(), "torch": torch.__version__,
                "threads": torch.get_num_threads(), "text": TEXT_PATH.name,
                "text_tokens": len(tokens), "ctx": args.ctx, "windows": len(wins),
                "scored_tokens": scored, "paths": args.paths, "dtype": args.dtype,
                "prompts": PROMPTS, "greedy_tokens": GREEDY_TOKENS,
                "llamacpp_kld_file": str(kld_path) if llamacpp else None,
                "results": [asdict(r) for r in results]}
        args.json.write_text(json.dumps(data, indent=2, default=str) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
