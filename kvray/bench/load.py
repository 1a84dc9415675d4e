"""The load: when each request is sent, and how many may be in flight at once.

Arrivals follow ``vllm bench serve``: at rate ``inf`` all requests start at once; else
the gaps between them are gamma-distributed with shape ``burstiness`` and mean
``1 / rate`` (burstiness 1 is a Poisson process, below 1 burstier, above 1 more even,
``inf`` evenly spaced), scaled so that the last request arrives at ``n / rate``: the mean
rate is the one asked for whatever the seed. ``max_concurrency`` caps the requests in
flight; a request waiting for a slot has not started, so its TTFT does not include the wait.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvray.bench.client import Endpoint, RequestOutput
    from kvray.bench.datasets import SampleRequest

REQUEST_TIMEOUT_S = 6 * 3600  # one request, stream included (vLLM's bound)


def arrival_times(num_requests: int, request_rate: float, burstiness: float = 1.0,
                  seed: int = 0) -> list[float]:
    """Seconds from the start at which each request is sent (non-decreasing)."""
    if request_rate <= 0 or burstiness <= 0:
        raise ValueError(f"request rate {request_rate} and burstiness {burstiness} must be > 0")
    if math.isinf(request_rate) or num_requests == 0:
        return [0.0] * num_requests
    rng = random.Random(seed)
    if math.isinf(burstiness):
        gaps = [1.0 / request_rate] * num_requests
    else:
        scale = 1.0 / (request_rate * burstiness)
        gaps = [rng.gammavariate(burstiness, scale) for _ in range(num_requests)]
    times, total = [], 0.0
    for gap in gaps:
        total += gap
        times.append(total)
    stretch = num_requests / request_rate / total
    return [t * stretch for t in times]


async def run_load(endpoint: Endpoint, requests: list[SampleRequest], request_rate: float,
                   burstiness: float = 1.0, max_concurrency: int | None = None,
                   seed: int = 0, on_done: Callable[[], None] | None = None,
                   ) -> tuple[list[RequestOutput], float]:
    """Send ``requests`` at :func:`arrival_times`, at most ``max_concurrency`` at once;
    their outputs (in the order given) and the seconds from the first send to the last
    answer. ``on_done`` is called as each request finishes (a progress bar)."""
    import aiohttp

    from kvray.bench.client import send_request

    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"--max-concurrency {max_concurrency}: must be >= 1")
    offsets = arrival_times(len(requests), request_rate, burstiness, seed)
    slots = asyncio.Semaphore(max_concurrency or max(len(requests), 1))
    # a connection per request, as vLLM's benchmark makes: a pooled keep-alive one the
    # server closed while idle (llama-server's after 5 s) fails the next request sent on it
    connector = aiohttp.TCPConnector(limit=max_concurrency or 0, force_close=True)
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def one(request: SampleRequest) -> RequestOutput:
            async with slots:
                output = await send_request(session, endpoint, request)
            if on_done is not None:
                on_done()
            return output

        start = time.perf_counter()
        tasks = []
        for request, offset in zip(requests, offsets, strict=True):
            delay = start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(request)))
        outputs = await asyncio.gather(*tasks)
    return list(outputs), time.perf_counter() - start
