"""Helpers shared by the test modules; fixtures live in ``tests/conftest.py``.

- ``skips``: skip a test whose prerequisite is missing (and fail instead in CI).
- ``server``: run ``kvray serve`` in a subprocess and wait for it to be healthy.
- ``serve_faults``: find a server's processes, stream requests, check recovery and drain.
- ``http_checks``: what an HTTP API response must not contain; findings collected once.
- ``hostile_requests``: requests every front end is fuzzed with.
- ``shadow_kv``: a shadow of the workers' KV cache that checks the scheduler's block tables.
- ``tiny_models`` / ``tiny_gguf``: tiny random models (HF and GGUF) saved on disk.
- ``ports``, ``k8s_tools``, ``prometheus_tools``, ``structured_schemas``,
  ``multinode_driver``: one tool each, named by the file.
"""
