"""``kvray serve`` in a subprocess for the tests: start it on a free loopback port, wait until
it is healthy, stop it with Ctrl-C."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import httpx
import pytest

from tests.helpers.ports import free_port

API_KEY = "test-key-123"
ENGINE_FLAGS = ["--dtype", "float32", "--block-size", "4", "--max-model-len", "1024",
                "--max-num-seqs", "16", "--num-gpu-blocks-override", "400"]


@contextlib.contextmanager
def launch_server(model_dir: str | Path, extra: Sequence[str] = ()) -> Iterator[str]:
    """Run `kvray serve` (its own loopback Ray cluster) until the block exits; yield its URL.

    ``extra`` flags come after :data:`ENGINE_FLAGS`, so they win."""
    port = free_port()
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    env.pop("RAY_ADDRESS", None)
    # A file, not a pipe: nobody reads a pipe while the server runs, and once its buffer
    # is full every print of the server blocks (its drain and shutdown included).
    with tempfile.TemporaryFile(mode="w+") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvray.cli", "serve", str(model_dir), "--port", str(port),
             "--api-key", API_KEY, *ENGINE_FLAGS, *extra],
            stdout=log, stderr=subprocess.STDOUT, text=True, env=env)
        base = f"http://127.0.0.1:{port}"

        def exited() -> str | None:
            if proc.poll() is None:
                return None
            log.seek(0)
            return f"kvray serve exited: {log.read()[-3000:]}"

        try:
            wait_for_health(base, 180, exited)
            yield base
        finally:
            stop_process(proc)


def stop_process(proc: subprocess.Popen, timeout_s: float = 60) -> None:
    """Ctrl-C a server process; kill it if it has not stopped within ``timeout_s``."""
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()


def wait_for_health(base: str, timeout_s: float,
                    failed: Callable[[], str | None] = lambda: None) -> None:
    """Poll ``base``/health until it answers 200; fail the test after ``timeout_s`` or as
    soon as ``failed()`` returns a message (the server process exited, say)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        why = failed()
        if why is None and time.monotonic() > deadline:
            why = f"no healthy answer from {base} within {timeout_s:g} s"
        if why is not None:
            pytest.fail(why)
        time.sleep(1)


def openai_client(base: str):
    """The official ``openai`` client for the server at ``base``, with the test API key."""
    import openai

    return openai.OpenAI(base_url=f"{base}/v1", api_key=API_KEY)
