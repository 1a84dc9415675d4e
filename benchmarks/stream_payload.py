"""Bytes that cross from a model replica to the ingress for one long streamed completion.

Runs kvray's Serve model deployment (``LLMServer``) on a private loopback Ray cluster, streams
one completion of ``--tokens`` tokens through a Serve handle, exactly as the HTTP ingress
does, and adds up the pickled size of every output that arrives. It does so once with
cumulative outputs (what kvray sent before issue 8: the whole text, token ids and logprobs
every step) and once with delta outputs (what the ingress asks for now). Linear means the
bytes per token stay flat as the completion grows.

Usage:
    python benchmarks/stream_payload.py [--tokens 1000] [--model DIR] [--logprobs 1]
"""

from __future__ import annotations

import argparse
import asyncio
import pickle
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


async def stream_bytes(handle, request_id: str, params) -> tuple[int, int, int]:
    """(outputs received, pickled bytes, generated tokens) of one streamed request."""
    count = size = tokens = 0
    cumulative = params.output_kind.name == "CUMULATIVE"
    gen = handle.options(stream=True).generate.remote(request_id, "Once upon a time", params)
    async for out in gen:
        count += 1
        size += len(pickle.dumps(out))
        new = sum(len(c.token_ids) for c in out.outputs)
        tokens = new if cumulative else tokens + new
    return count, size, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1000, help="tokens per completion")
    ap.add_argument("--model", default=None, help="model directory (default: built-in)")
    ap.add_argument("--logprobs", type=int, default=1, help="top logprobs per token (or -1)")
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()

    from ray import serve

    from kvray.actors.ray_executor import ensure_ray
    from kvray.config import config_from_flat
    from kvray.hardware import describe
    from kvray.models.default_model import resolve_model_path
    from kvray.sampling_params import RequestOutputKind, SamplingParams
    from kvray.serve.replica import LLMServer

    print(describe())
    model = str(resolve_model_path(args.model))
    ensure_ray(num_cpus=4)
    engine_config = {"model": model, "dtype": args.dtype, "max_model_len": args.tokens + 64}
    handle = serve.run(LLMServer.bind(config_from_flat(engine_config), "kvray-stats-payload"),
                       name="payload", route_prefix=None)
    rows = []
    try:
        for kind in (RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA):
            params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True,
                                    logprobs=None if args.logprobs < 0 else args.logprobs,
                                    output_kind=kind)
            start = time.perf_counter()
            count, size, tokens = asyncio.run(stream_bytes(handle, kind.name, params))
            rows.append((kind.name.lower(), count, tokens, size, time.perf_counter() - start))
    finally:
        serve.shutdown()
    print(f"\nmodel {Path(model).name}, one completion of {args.tokens} tokens, "
          f"logprobs={args.logprobs}")
    print("| outputs | messages | tokens | bytes replica -> ingress | bytes / token | wall s |")
    print("|---|---|---|---|---|---|")
    for name, count, tokens, size, wall in rows:
        print(f"| {name} | {count} | {tokens} | {size:,} | {size / max(tokens, 1):,.0f} | "
              f"{wall:.1f} |")
    print(f"| ratio cumulative / delta | | | {rows[0][3] / rows[1][3]:.1f}x | | |")


if __name__ == "__main__":
    main()
