"""One streaming request to an OpenAI-compatible server, timed chunk by chunk.

``openai`` sends ``/v1/completions`` requests (a text or token-id prompt, ``max_tokens``),
``openai-chat`` sends ``/v1/chat/completions`` ones (the prompt as one user message,
``max_completion_tokens``). Both stream with ``stream_options.include_usage``, so the
server's own token counts come back in the last chunk; a server that sends none leaves
them to :func:`kvray.bench.metrics.output_token_count`.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import aiohttp

    from kvray.bench.datasets import SampleRequest

BACKENDS = {"openai": "/v1/completions", "openai-chat": "/v1/chat/completions"}
MAX_ERROR_CHARS = 500  # of a failed response's body, kept as the request's error


@dataclass(frozen=True)
class Endpoint:
    """Where and how every request of a run is sent."""

    url: str  # the full URL: base + endpoint path
    backend: str  # a key of BACKENDS
    model: str
    api_key: str | None = None
    extra_body: dict[str, Any] = field(default_factory=dict)  # temperature, ignore_eos, ...

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def body(self, request: SampleRequest) -> dict[str, Any]:
        """The JSON body that asks for ``request``, streamed with usage."""
        body: dict[str, Any] = {"model": self.model, "stream": True,
                                "stream_options": {"include_usage": True}}
        if self.backend == "openai-chat":
            if not isinstance(request.prompt, str):
                raise ValueError("--backend openai-chat: prompts must be text, not token ids")
            body["messages"] = [{"role": "user", "content": request.prompt}]
            body["max_completion_tokens"] = request.output_len
        else:
            body["prompt"] = request.prompt
            body["max_tokens"] = request.output_len
        return {**body, **self.extra_body}


@dataclass
class RequestOutput:
    """What one request measured; times in seconds from ``time.perf_counter``."""

    success: bool = False
    generated_text: str = ""
    prompt_len: int = 0  # the server's usage.prompt_tokens, else the workload's count
    output_tokens: int = 0  # the server's usage.completion_tokens; 0 when it sent none
    num_chunks: int = 0  # chunks that carried text
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)  # between consecutive text chunks
    latency: float = 0.0  # request sent to stream ended
    start_time: float = 0.0
    error: str = ""


def chunk_text(chunk: dict[str, Any]) -> str:
    """The text a streamed chunk carries: a completion's ``text`` or a chat ``delta``'s
    content (reasoning included); empty for role-only, finish and usage chunks."""
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if "delta" in choice:
        delta = choice["delta"] or {}
        return (delta.get("content") or "") + (delta.get("reasoning_content") or "")
    return choice.get("text") or ""


class _Stream:
    """Folds SSE data lines into a :class:`RequestOutput`, timing the text chunks."""

    def __init__(self, output: RequestOutput) -> None:
        self.out = output
        self.last = output.start_time
        self.parts: list[str] = []
        self.first_choice: float | None = None  # a chunk with choices, text or not

    def feed(self, line: str, now: float) -> bool:
        """Take one line; False once the stream says it is done or failed."""
        if not line.startswith("data:"):
            return True  # blank separators, ": keep-alive" comments, event names
        data = line[5:].strip()
        if data == "[DONE]":
            return False
        chunk = json.loads(data)
        if not isinstance(chunk, dict):
            return True
        if chunk.get("error"):
            err = chunk["error"]
            self.out.error = str(err.get("message", err) if isinstance(err, dict) else err)
            return False
        if usage := chunk.get("usage"):
            self.out.output_tokens = usage.get("completion_tokens") or 0
            self.out.prompt_len = usage.get("prompt_tokens") or self.out.prompt_len
        if chunk.get("choices") and self.first_choice is None:
            self.first_choice = now
        if text := chunk_text(chunk):
            if self.out.num_chunks == 0:
                self.out.ttft = now - self.out.start_time
            else:
                self.out.itl.append(now - self.last)
            self.last = now
            self.out.num_chunks += 1
            self.parts.append(text)
        return True


async def send_request(session: aiohttp.ClientSession, endpoint: Endpoint,
                       request: SampleRequest) -> RequestOutput:
    """Send ``request`` and read its stream to the end. Never raises for what the server
    or the network does: a failure comes back as ``success=False`` with ``error`` set."""
    import aiohttp

    out = RequestOutput(prompt_len=request.prompt_len, start_time=time.perf_counter())
    stream = _Stream(out)
    try:
        async with session.post(endpoint.url, json=endpoint.body(request),
                                headers=endpoint.headers()) as resp:
            if resp.status != 200:
                body = (await resp.text(errors="replace")).strip()[:MAX_ERROR_CHARS]
                out.error = f"HTTP {resp.status} {resp.reason or ''}".strip() + (
                    f": {body}" if body else "")
                return out
            async for raw in resp.content:
                if not stream.feed(raw.decode("utf-8").rstrip("\r\n"), time.perf_counter()):
                    break
    except (aiohttp.ClientError, TimeoutError, ValueError) as err:  # JSON, UTF-8, a long line
        out.error = f"{type(err).__name__}: {err}"
    out.latency = time.perf_counter() - out.start_time
    out.generated_text = "".join(stream.parts)
    if not out.error and out.num_chunks == 0:
        # Only empty-text chunks (an immediate EOS, say): answered, with nothing to show.
        if stream.first_choice is None:
            out.error = "the stream ended without any choices"
        else:
            out.ttft = stream.first_choice - out.start_time
    out.success = not out.error
    return out
