"""HTTP plumbing shared by the OpenAI app and its handlers: the error type that becomes an
OpenAI error response, Server-Sent Events framing, and running several output streams."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

from fastapi.responses import JSONResponse, StreamingResponse

from kvray.serve.protocol import error_body


class APIError(Exception):
    """An error the client sees as OpenAI's error JSON with this HTTP status."""

    def __init__(self, status: int, message: str, err_type: str, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.err_type = status, message, err_type
        self.param, self.headers = param, headers


def error_response(status: int, message: str, err_type: str, param: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    """OpenAI's error JSON with ``status``."""
    return JSONResponse(error_body(message, err_type, status, param), status_code=status,
                        headers=headers)


def sse(payload: dict | str) -> str:
    """One Server-Sent Event: ``data: <compact JSON or literal>`` and a blank line."""
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


def streaming_response(gen: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(gen, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


async def drain(streams: list[AsyncIterator]) -> None:
    """Run several output streams concurrently to their end."""
    async def consume(stream: AsyncIterator) -> None:
        async for _ in stream:
            pass

    await asyncio.gather(*(consume(s) for s in streams))
