"""The OpenAI-compatible HTTP API as a FastAPI app over an engine client.

The client is anything with ``generate(request_id, prompt, params, priority)`` (an async
iterator of the request's :class:`RequestOutput` in the kind its params ask for: the
handlers ask for deltas), ``engine_stats()`` (list of (replica, dict)) and ``tokenizer``:
the in-process :class:`AsyncLLM`, or the Ray Serve handle wrapper.
"""

from __future__ import annotations

import hmac
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

import kvray
from kvray.outputs import RequestOutput
from kvray.serve.completions import ChatHandler, CompletionHandler
from kvray.serve.http import APIError, error_response
from kvray.serve.metrics import ServerMetrics
from kvray.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ProtocolError,
    TokenizeRequest,
    now,
)

logger = logging.getLogger("kvray.serve")


class OpenAIServer:
    """Routes and request handling; ``app`` is the FastAPI application."""

    def __init__(self, client: Any, model_name: str, max_model_len: int,
                 api_key: str | None = None, max_waiting: int = 512,
                 app: FastAPI | None = None) -> None:
        self.client, self.model_name = client, model_name
        self.max_model_len, self.api_key, self.max_waiting = max_model_len, api_key, max_waiting
        self.tokenizer = client.tokenizer
        self.metrics = ServerMetrics(model_name)
        self.app = app if app is not None else FastAPI(title="kvray", version=kvray.__version__)
        self._install_handlers()
        self._install_routes()

    # ---- plumbing -----------------------------------------------------------------------
    def _install_handlers(self) -> None:
        app = self.app

        @app.exception_handler(APIError)
        async def _api_error(_: Request, err: APIError):
            return error_response(err.status, err.message, err.err_type, err.param, err.headers)

        @app.exception_handler(RequestValidationError)
        async def _invalid(_: Request, err: RequestValidationError):
            first = err.errors()[0] if err.errors() else {}
            loc0 = tuple(first.get("loc", ()))
            if first.get("type") == "json_invalid" or (
                    loc0 == ("body",) and first.get("type") == "model_attributes_type"):
                return error_response(400, "request body is not valid JSON", "BadRequestError")
            loc = [str(x) for x in first.get("loc", ()) if x != "body"]
            param = ".".join(loc) or None
            return error_response(400, f"{param or 'body'}: {first.get('msg', 'invalid')}",
                          "BadRequestError", param)

        @app.exception_handler(StarletteHTTPException)
        async def _http(_: Request, err: StarletteHTTPException):
            kind = "NotFoundError" if err.status_code == 404 else "BadRequestError"
            return error_response(err.status_code, str(err.detail), kind)

        @app.exception_handler(Exception)
        async def _internal(_: Request, err: Exception):
            logger.exception("internal error")
            return error_response(500, f"internal server error: {err.__class__.__name__}",
                          "InternalServerError")

        @app.middleware("http")
        async def _auth(request: Request, call_next):
            protected = request.url.path.startswith(("/v1", "/tokenize", "/detokenize"))
            if self.api_key and protected:
                given = request.headers.get("authorization", "")
                expected = f"Bearer {self.api_key}"
                if not hmac.compare_digest(given.encode(), expected.encode()):
                    return error_response(401, "invalid or missing API key", "AuthenticationError")
            return await call_next(request)

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"model '{model}' does not exist; this server serves "
                           f"'{self.model_name}'", "NotFoundError", "model")

    def _check_capacity(self) -> None:
        waiting = sum(s.get("num_waiting", 0) for _, s in self.client.engine_stats())
        if waiting >= self.max_waiting:
            raise APIError(503, f"server overloaded: {waiting} requests waiting",
                           "ServiceUnavailableError", headers={"Retry-After": "1"})

    def resolve_max_tokens(self, requested: int | None, prompt_len: int) -> int:
        """``max_tokens`` for a prompt: as requested, or all the room left in the context;
        an APIError (400) when prompt + max_tokens exceeds the context length."""
        room = self.max_model_len - prompt_len
        if requested is None:
            requested = room
        if prompt_len + requested > self.max_model_len or room < 1:
            raise APIError(400, f"prompt ({prompt_len} tokens) + max_tokens ({requested}) "
                           f"exceeds the model's context length ({self.max_model_len})",
                           "BadRequestError", "max_tokens")
        return requested

    # ---- routes -------------------------------------------------------------------------
    def _install_routes(self) -> None:
        app = self.app
        app.get("/health")(self.health)
        app.get("/version")(self.version)
        app.get("/metrics")(self.metrics_endpoint)
        app.get("/v1/models")(self.models)
        app.post("/tokenize")(self.tokenize)
        app.post("/detokenize")(self.detokenize)
        app.post("/v1/completions")(self.completions)
        app.post("/v1/chat/completions")(self.chat_completions)

    async def health(self) -> Response:
        return Response(status_code=200)

    async def version(self) -> dict:
        return {"version": kvray.__version__}

    async def metrics_endpoint(self) -> Response:
        for replica, stats in self.client.engine_stats():
            self.metrics.set_engine_stats(replica, stats)
        return Response(self.metrics.render(), media_type="text/plain; version=0.0.4")

    async def models(self) -> dict:
        return {"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": now(), "owned_by": "kvray",
            "root": self.model_name, "max_model_len": self.max_model_len}]}

    async def tokenize(self, req: TokenizeRequest) -> dict:
        self._check_model(req.model)
        if req.messages is not None:
            conv = [{"role": m.role, "content": m.content or ""} for m in req.messages]
            ids = self.chat_prompt_ids(conv, req.add_generation_prompt)
        elif req.prompt is not None:
            ids = self.tokenizer(req.prompt, add_special_tokens=req.add_special_tokens
                                 )["input_ids"]
        else:
            raise APIError(400, "give 'prompt' or 'messages'", "BadRequestError", "prompt")
        return {"tokens": ids, "count": len(ids), "max_model_len": self.max_model_len}

    async def detokenize(self, req: DetokenizeRequest) -> dict:
        self._check_model(req.model)
        vocab = len(self.tokenizer)
        if any(not 0 <= t < vocab for t in req.tokens):
            raise APIError(400, f"tokens must be ids in [0, {vocab})", "BadRequestError",
                           "tokens")
        return {"prompt": self.tokenizer.decode(req.tokens)}

    def chat_prompt_ids(self, conv: list[dict], add_generation_prompt: bool) -> list[int]:
        """Token ids of a conversation through the chat template (400 if it has none or
        rejects the messages)."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise APIError(400, "this model has no chat template; use /v1/completions",
                           "BadRequestError", "messages")
        try:
            return list(self.tokenizer.apply_chat_template(
                conv, add_generation_prompt=add_generation_prompt, tokenize=True,
                return_dict=True)["input_ids"])
        except Exception as err:  # the template rejects these messages (jinja2 raises)
            raise APIError(400, f"the chat template rejected the messages: {err}",
                           "BadRequestError", "messages") from None

    async def completions(self, req: CompletionRequest):
        self._check_model(req.model)
        self._check_capacity()
        return await CompletionHandler(self, req).run()

    async def chat_completions(self, req: ChatCompletionRequest):
        self._check_model(req.model)
        self._check_capacity()
        return await ChatHandler(self, req).run()

    # ---- shared by handlers -------------------------------------------------------------
    async def stream(self, request_id: str, prompt: Any, params, priority: int
                     ) -> AsyncIterator:
        """The engine's output stream, with invalid-request errors turned into 400s."""
        gen = self.client.generate(request_id, prompt, params, priority)
        try:
            first = await gen.__anext__()
        except StopAsyncIteration:
            return
        except ProtocolError as err:
            raise APIError(400, str(err), "BadRequestError", err.param) from None
        except ValueError as err:
            raise APIError(400, str(err), "BadRequestError") from None
        yield first
        async for out in gen:
            yield out

    def record(self, out: RequestOutput, start: float, token_times: list[float]) -> None:
        """Request-level metrics and the one log line per request, from the request's
        folded output (finished, or cut short when the client went away)."""
        e2e = time.monotonic() - start
        gen_tokens = sum(len(c.token_ids) for c in out.outputs)
        reasons = [c.finish_reason for c in out.outputs]
        reason = "abort" if not out.finished or None in reasons else reasons[0]
        m = out.metrics
        ttft = (token_times[0] - start) if token_times else None
        itl = [b - a for a, b in zip(token_times, token_times[1:], strict=False)]
        self.metrics.observe_request(len(out.prompt_token_ids), gen_tokens, reason,
                                     m.queue_time if m else None, ttft, e2e, itl)
        logger.info("request %s: %d prompt + %d generated tokens, %s, %.3f s",
                    out.request_id, len(out.prompt_token_ids), gen_tokens, reason, e2e)
