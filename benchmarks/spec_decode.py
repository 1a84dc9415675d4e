"""Speculative decoding: speed-up and acceptance rate, against plain decoding in the same run.

Workloads, on the built-in SmolLM2-135M-Instruct, fixed prompts:

- ``edit`` (greedy): high n-gram overlap — the model is asked to repeat or lightly edit a
  passage given in the prompt (what summarising/editing/code-editing traffic looks like),
  so n-gram prompt lookup finds long runs to propose;
- ``random`` (sampled at temperature 1, seeded): prompts of random token ids, little to
  look up, so this is the cost when drafts rarely appear or hit (greedy decoding of random
  prompts falls into loops, which n-grams predict well: not the case to measure here).

Each runs at batch 1 and batch 8 without speculation, then with ``ngram``, and with a draft
model: ``--draft-model DIR`` (a smaller model with the same tokenizer), or by default the
built-in model cut to its first ``--draft-layers`` layers (same embeddings, final norm and
head: the only smaller same-tokenizer model there is offline). Reports output tokens/s,
the speed-up over plain decoding, drafts proposed per output token and the acceptance rate
(accepted / proposed). Greedy outputs are checked identical (sampled ones follow the same
distribution, not the same draws: tests/test_spec_decode.py).

Usage:
    python benchmarks/spec_decode.py [--k 4] [--max-tokens 128] [--dtype auto]
        [--draft-model DIR | --draft-layers 8] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import benchmark_dtype  # noqa: E402

PASSAGE = (
    "Ray is an open-source framework for scaling Python applications. It provides a small "
    "set of primitives: tasks, actors and objects. Tasks are stateless functions that run "
    "remotely, actors are stateful workers, and objects are immutable values in a "
    "distributed object store. Ray Serve builds on these to serve models online, and Ray "
    "Data streams datasets through them. A cluster has one head node and any number of "
    "worker nodes; the autoscaler adds and removes workers as the load changes. "
)
EDIT_PROMPTS = [
    f"Copy the following text exactly, without changes.\n\nText: {PASSAGE}\n\nCopy: Ray is",
    f"Rewrite the text, replacing 'Ray' with 'Orbit'.\n\nText: {PASSAGE}\n\nRewritten: Orbit",
    "Fix the typo and repeat the code.\n\ndef mean(values):\n    total = 0\n    for v in "
    "values:\n        total += v\n    retrun total / len(values)\n\nFixed:\ndef mean(values):",
    f"Summarise by quoting the first sentences.\n\n{PASSAGE}\n\nQuote: Ray is an",
]


def random_prompts(n: int, vocab: int, length: int, seed: int) -> list[list[int]]:
    rnd = random.Random(seed)
    return [[rnd.randrange(100, vocab) for _ in range(length)] for _ in range(n)]


def truncated_draft(layers: int) -> str:
    """The built-in model's first ``layers`` decoder layers as a model of its own."""
    import tempfile

    import transformers

    from kvray.models.default_model import default_model_dir

    src = default_model_dir()
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype="auto")
    model.model.layers = model.model.layers[:layers]
    model.config.num_hidden_layers = layers
    out = Path(tempfile.mkdtemp(prefix="kvray-draft-")) / f"smollm2-{layers}-layers"
    model.save_pretrained(out)
    transformers.AutoTokenizer.from_pretrained(src).save_pretrained(out)
    return str(out)


def run(llm: Any, prompts: list[Any], max_tokens: int, temperature: float = 0.0
        ) -> tuple[float, list[list[int]]]:
    from kvray import SamplingParams

    params = SamplingParams(temperature=temperature, seed=0, max_tokens=max_tokens,
                            ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start, [o.outputs[0].token_ids for o in outs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--draft-model", default=None)
    parser.add_argument("--draft-layers", type=int, default=8,
                        help="without --draft-model: the built-in model cut to N layers "
                        "(0: no draft-model rows)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    dtype = benchmark_dtype(args.dtype)

    from kvray import LLM

    systems: list[tuple[str, dict | None]] = [
        ("plain", None),
        (f"ngram k={args.k}", {"method": "ngram", "num_speculative_tokens": args.k,
                               "prompt_lookup_max": 4}),
    ]
    draft = args.draft_model or (truncated_draft(args.draft_layers) if args.draft_layers
                                 else None)
    if draft:
        label = Path(draft).name
        systems.append((f"draft {label} k={args.k}", {"model": draft,
                                                      "num_speculative_tokens": args.k}))
    rows: list[dict[str, Any]] = []
    for name, spec in systems:
        llm = LLM(dtype=dtype, speculative_config=spec, max_num_seqs=16)
        vocab = llm.llm_engine.spec.vocab_size
        workloads = {
            "edit b=1": [EDIT_PROMPTS[0]],
            "edit b=8": (EDIT_PROMPTS * 2)[:8],
            "random b=1": [{"prompt_token_ids": p} for p in random_prompts(1, vocab, 64, 1)],
            "random b=8": [{"prompt_token_ids": p} for p in random_prompts(8, vocab, 64, 2)],
        }
        run(llm, [EDIT_PROMPTS[1]], 16)  # warm-up
        for wl, prompts in workloads.items():
            stats = llm.llm_engine.stats
            d0 = stats.spec_decode_num_draft_tokens
            a0 = stats.spec_decode_num_accepted_tokens
            secs, tokens = run(llm, prompts, args.max_tokens,
                               1.0 if wl.startswith("random") else 0.0)
            stats = llm.llm_engine.stats
            drafts = stats.spec_decode_num_draft_tokens - d0
            accepted = stats.spec_decode_num_accepted_tokens - a0
            out_tokens = sum(len(t) for t in tokens)
            rows.append({"system": name, "workload": wl, "seconds": secs,
                         "tok_s": out_tokens / secs, "drafts": drafts, "accepted": accepted,
                         "out_tokens": out_tokens, "tokens": tokens})
            print(f"{name:>12} {wl:>10}: {out_tokens / secs:7.1f} tok/s", flush=True)
        llm.shutdown()

    plain = {r["workload"]: r for r in rows if r["system"] == "plain"}
    print("\n| system | workload | output tok/s | vs plain | drafts / output token | "
          "acceptance | tokens equal |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        base = plain[r["workload"]]
        acc = f"{r['accepted'] / r['drafts']:.0%}" if r["drafts"] else "—"
        same = r["tokens"] == base["tokens"] if r["workload"].startswith("edit") \
            else "sampled"
        print(f"| {r['system']} | {r['workload']} | {r['tok_s']:.1f} | "
              f"{r['tok_s'] / base['tok_s']:.2f}× | {r['drafts'] / r['out_tokens']:.2f} | "
              f"{acc} | {same} |")
    if args.json:
        Path(args.json).write_text(json.dumps(
            [{k: v for k, v in r.items() if k != "tokens"} for r in rows], indent=2))


if __name__ == "__main__":
    main()
