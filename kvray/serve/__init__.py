"""Serving: OpenAI-compatible HTTP API on Ray Serve, streaming, metrics.

``kvray.serve:build_app`` is the Serve application builder (``serve run``, Serve config
files, KubeRay); importing this package stays cheap (Ray and FastAPI load on use).
"""

from kvray.serve.builder import build_app

__all__ = ["build_app"]
