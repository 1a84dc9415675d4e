"""``kvray bench``: client-side benchmarks of any OpenAI-compatible server.

``kvray bench serve`` (:mod:`kvray.bench.serve`) takes ``vllm bench serve``'s flags and
writes its result JSON: a workload (:mod:`~kvray.bench.datasets`) sent as streaming requests
(:mod:`~kvray.bench.client`) at a Poisson or gamma arrival rate and a concurrency cap
(:mod:`~kvray.bench.load`), measured as TTFT / TPOT / ITL / E2E latency and throughput
(:mod:`~kvray.bench.metrics`), printed and saved (:mod:`~kvray.bench.report`).

This package imports nothing heavy at module level: ``kvray --help`` builds the ``bench``
parser (:mod:`kvray.bench.cli`) without loading aiohttp, numpy or transformers.
"""
