"""HTTP plumbing shared by the OpenAI app and its handlers: the error type that becomes an
OpenAI error response, Server-Sent Events framing, and running several output streams."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator

from fastapi.responses import JSONResponse, StreamingResponse

from kvray.errors import InvalidRequestError, KVRayError
from kvray.serve.protocol import error_body

logger = logging.getLogger("kvray.serve")


class APIError(Exception):
    """An error the client sees as OpenAI's error JSON with this HTTP status."""

    def __init__(self, status: int, message: str, err_type: str, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.err_type = status, message, err_type
        self.param, self.headers = param, headers


def root_cause(err: BaseException) -> BaseException:
    """The exception raised where the error happened: Ray wraps an exception raised in
    another process (``RayTaskError``, whose text holds the remote traceback, pid and
    address) and keeps the original as ``cause``."""
    seen = set()
    while id(err) not in seen:
        seen.add(id(err))
        cause = getattr(err, "cause", None)
        if not isinstance(cause, BaseException):
            break
        err = cause
    return err


_BUSY = ("BackPressureError", "DeploymentUnavailableError")  # Ray Serve: queue full / no replica
_REPLICA_GONE = ("RayActorError", "ActorDiedError", "ActorUnavailableError",
                 "WorkerCrashedError", "NodeDiedError", "RaySystemError",
                 "ObjectLostError", "OwnerDiedError", "GetTimeoutError", "TaskCancelledError")


def api_error_from(err: BaseException) -> APIError:
    """The client's view of ``err``: kvray's own errors keep their status and message;
    Ray's are named by what they mean (busy, replica failed); anything else is an internal
    error whose details stay in the server log, never in the response."""
    if isinstance(err, APIError):
        return err
    cause = root_cause(err)
    if isinstance(cause, KVRayError):
        retry = getattr(cause, "retry_after_s", None)
        return APIError(cause.status, cause.message, cause.err_type, cause.param,
                        {"Retry-After": str(retry)} if retry else None)
    names = {c.__name__ for c in type(err).__mro__} | {c.__name__ for c in type(cause).__mro__}
    if names & set(_BUSY):
        return APIError(503, "the server is busy; retry shortly", "ServiceUnavailableError",
                        headers={"Retry-After": "1"})
    if names & set(_REPLICA_GONE):
        logger.warning("a model replica failed: %s", err.__class__.__name__)
        return APIError(503, "the model replica serving this request failed; the request "
                        "was aborted, retry it", "ServiceUnavailableError",
                        headers={"Retry-After": "1"})
    if isinstance(cause, ValueError) and not isinstance(cause, InvalidRequestError):
        logger.info("invalid request: %s", cause)
        return APIError(400, _first_line(str(cause)), "BadRequestError")
    logger.error("internal error", exc_info=(type(err), err, err.__traceback__))
    return APIError(500, "internal server error", "InternalServerError")


def _first_line(text: str, limit: int = 500) -> str:
    return text.strip().splitlines()[0][:limit] if text.strip() else "invalid request"


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
