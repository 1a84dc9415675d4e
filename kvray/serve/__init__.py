"""Serving: OpenAI-compatible HTTP API on Ray Serve, streaming, metrics."""
