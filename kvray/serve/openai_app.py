"""The OpenAI-compatible HTTP API as a FastAPI app over an engine client.

The client is anything with ``generate(request_id, prompt, params, priority)`` (an async
iterator of the request's :class:`RequestOutput` in the kind its params ask for: the
handlers ask for deltas), ``engine_stats()`` (list of (replica, dict)) and ``tokenizer``:
the in-process :class:`AsyncLLM`, or the Ray Serve handle wrapper.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import PurePath
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

import kvray
from kvray.config import LoRAConfig, ServerConfig
from kvray.errors import InvalidRequestError, KVRayError
from kvray.inputs import detect_content_format
from kvray.outputs import RequestOutput
from kvray.serve.completions import ChatHandler, CompletionHandler
from kvray.serve.http import APIError, api_error_from, error_response
from kvray.serve.metrics import ServerMetrics
from kvray.serve.pooling_api import (
    ClassificationRequest,
    EmbeddingRequest,
    PoolingRequest,
    RerankRequest,
    ScoreRequest,
    create_classification,
    create_embeddings,
    create_pooling,
    create_rerank,
    create_scores,
)
from kvray.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoRAAdapterRequest,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
    check_messages,
    check_template_kwargs,
    conversation_of,
    now,
    template_tools,
)
from kvray.serve.responses import ResponsesHandler, ResponsesRequest

logger = logging.getLogger("kvray.serve")
T = TypeVar("T")
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "literal"}
OPEN_PATHS = ("/health", "/ping", "/version")  # never need the API key (/metrics: configurable)


def _path_naming(model: str, served_name: str) -> bool:
    """Whether ``model`` is a path to the served model: vLLM serves a model under the
    path it was given (its default served name), kvray under the directory's name, so
    clients moving from vLLM may send the path."""
    if "/" not in model and "\\" not in model:
        return False
    path = PurePath(model.rstrip("/\\"))
    return (path.stem if path.suffix == ".gguf" else path.name) == served_name


class _Gate:
    """ASGI middleware in front of every route: the API key, the request body limit
    (read here, bounded, then handed on) and the drain state."""

    def __init__(self, app, server: OpenAIServer) -> None:
        self.app, self.server = app, server

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        refusal = self._refusal(scope)
        if refusal is not None:
            return await refusal(scope, receive, send)
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        limit = self.server.limits.max_request_bytes
        for name, value in scope["headers"]:
            if name == b"content-length" and value.isdigit() and int(value) > limit:
                return await self._too_large(scope, receive, send, limit)
        chunks, size = [], 0
        while True:  # the body, bounded, whatever the framing (chunked has no length)
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                return await self._too_large(scope, receive, send, limit)
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body, sent, gone = b"".join(chunks), False, asyncio.Event()

        async def replay():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await gone.wait()  # later: the client's disconnect, seen by the watcher
            return {"type": "http.disconnect"}

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            gone.set()

        # A client that goes away aborts its request (vLLM's with_cancellation): a stream
        # sees the disconnect through replay; a plain response never reads again, so its
        # handler is cancelled, which closes the engine stream and aborts the request.
        handler = asyncio.ensure_future(self.app(scope, replay, send))
        watcher = asyncio.ensure_future(watch())
        try:
            await asyncio.wait((handler, watcher), return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not handler.done():
                handler.cancel()
            watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            return await handler

    def _refusal(self, scope) -> Response | None:
        """401 without the API key (except on the open paths); 503 for a POST while
        draining; else None."""
        server = self.server
        open_paths = OPEN_PATHS if server.limits.metrics_require_key else (
            *OPEN_PATHS, "/metrics")
        if server.api_key and scope["path"] not in open_paths:
            given = b""
            for name, value in scope["headers"]:
                if name == b"authorization":
                    given = value
            expected = f"Bearer {server.api_key}".encode()
            if not hmac.compare_digest(given, expected):
                return error_response(401, "invalid or missing API key", "AuthenticationError")
        if server.draining and scope["method"] == "POST":
            return error_response(503, "the server is shutting down; retry on another "
                                  "replica", "ServiceUnavailableError",
                                  headers={"Retry-After": "5"})
        return None

    @staticmethod
    async def _too_large(scope, receive, send, limit: int) -> None:
        resp = error_response(413, f"request body exceeds the limit of {limit} bytes "
                              "(max_request_bytes)", "BadRequestError", "body")
        await resp(scope, receive, send)


class OpenAIServer:
    """Routes and request handling; ``app`` is the FastAPI application.

    ``limits`` (a :class:`ServerConfig`) bounds every request; ``enable_docs`` overrides
    its ``enable_docs``. Admission (how many sequences may wait) is the engine's: it knows
    its queue exactly, and every ingress replica shares it."""

    def __init__(self, client: Any, model_name: str, max_model_len: int,
                 api_key: str | None = None, limits: ServerConfig | None = None,
                 app: FastAPI | None = None, enable_docs: bool | None = None,
                 lora: LoRAConfig | None = None, model_head: str = "lm",
                 eos_token_ids: tuple[int, ...] | None = None,
                 sampling_defaults: dict[str, Any] | None = None,
                 model_labels: list[str] | None = None,
                 max_tokens_cap: int | None = None) -> None:
        self.client, self.model_name = client, model_name
        # lm | embed | classify (ModelSpec.head): /score and /rerank use the classification
        # head of a classify model, else embeddings' cosine similarity
        self.model_head = model_head
        # LoRA on: ``model`` may name an adapter (the client lists, loads and unloads them)
        self.lora = lora if lora is not None and lora.enabled else None
        self.max_model_len, self.api_key = max_model_len, api_key or None
        self.limits = limits if limits is not None else ServerConfig()
        if enable_docs is not None:
            self.limits = self.limits.model_copy(update={"enable_docs": enable_docs})
        self.tokenizer = client.tokenizer
        engine = getattr(client, "engine", None)  # in process: the engine's own facts
        if eos_token_ids is None:  # the engine's, where the caller knows them
            eos_token_ids = getattr(engine, "eos_token_ids", None) or (
                (self.tokenizer.eos_token_id,) if self.tokenizer.eos_token_id is not None
                else ())
        self.eos_token_ids = tuple(eos_token_ids)
        if model_labels is None:  # a classifier's class names, by index (for /classify)
            model_labels = getattr(getattr(engine, "spec", None), "labels", ())
        self.model_labels = tuple(model_labels)
        if sampling_defaults is None:  # the model's generation_config.json, via the engine
            sampling_defaults = getattr(engine, "sampling_defaults", None) or {}
        # unset request fields take these (vLLM's --generation-config auto)
        self.sampling_defaults = dict(sampling_defaults)
        if max_tokens_cap is None:  # max_new_tokens the server's config imposes, if any
            max_tokens_cap = getattr(engine, "max_tokens_cap", None)
        self.max_tokens_cap = max_tokens_cap
        self._model_content_format: str | None = None  # the model template's, once read
        self.metrics = ServerMetrics(model_name)
        self.draining = False
        self._abort: asyncio.Future | None = None  # set by abort_all: ends every stream
        self.num_in_flight = 0  # engine streams open (drain waits for 0)
        # One thread: tokenizing a huge prompt never blocks the event loop, and HF fast
        # tokenizers are not safe to call from several threads at once.
        self._tokenize_pool = ThreadPoolExecutor(1, thread_name_prefix="kvray-tokenize")
        docs = self.limits.enable_docs
        self.app = app if app is not None else FastAPI(
            title="kvray", version=kvray.__version__, docs_url="/docs" if docs else None,
            redoc_url="/redoc" if docs else None,
            openapi_url="/openapi.json" if docs else None)
        self._install_handlers()
        self._install_routes()
        self.app.add_middleware(_Gate, server=self)
        limits = self.limits
        if limits.allowed_origins:  # outside the gate: a browser's preflight has no API key
            self.app.add_middleware(
                CORSMiddleware, allow_origins=limits.allowed_origins,
                allow_methods=limits.allowed_methods, allow_headers=limits.allowed_headers,
                allow_credentials=limits.allow_credentials)

    async def off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """Run tokenizer work on the tokenizer thread."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenize_pool, fn, *args)

    # ---- plumbing -----------------------------------------------------------------------
    def _install_handlers(self) -> None:
        app = self.app

        async def _translated(_: Request, err: Exception):
            api = api_error_from(err)  # APIError as is; kvray's, Ray's and others mapped
            return error_response(api.status, api.message, api.err_type, api.param, api.headers)

        # Registered per class: Starlette re-raises what reaches the Exception handler.
        for kind in (APIError, KVRayError, Exception):
            app.add_exception_handler(kind, _translated)

        @app.exception_handler(RequestValidationError)
        async def _invalid(_: Request, err: RequestValidationError):
            errors = err.errors()
            first = errors[0] if errors else {}
            cause = (first.get("ctx") or {}).get("error")
            if isinstance(cause, InvalidRequestError):  # raised by one of our validators
                return error_response(400, cause.message, "BadRequestError", cause.param)
            loc0 = tuple(first.get("loc", ()))
            if first.get("type") == "json_invalid" or (
                    loc0 == ("body",) and first.get("type") == "model_attributes_type"):
                return error_response(400, "request body is not valid JSON (an object)",
                                      "BadRequestError")
            # a union's member types ("str", "list[int]") are not part of the field's name
            loc = [str(x) for x in first.get("loc", ()) if x != "body" and not (
                isinstance(x, str) and (x in _TYPE_TAGS or "[" in x or "(" in x))]
            param = ".".join(loc) or None
            return error_response(400, f"{param or 'body'}: {first.get('msg', 'invalid')}",
                                  "BadRequestError", param)

        @app.exception_handler(StarletteHTTPException)
        async def _http(_: Request, err: StarletteHTTPException):
            kind = "NotFoundError" if err.status_code == 404 else "BadRequestError"
            return error_response(err.status_code, str(err.detail), kind)

    def _check_model(self, model: str | None) -> str | None:
        """The LoRA adapter ``model`` names (None: the base model). Without LoRA anything
        but the base model's name is a 404 here; with LoRA the engine checks that the
        adapter exists when the request arrives (404 then)."""
        if model is None or model == self.model_name or _path_naming(model, self.model_name):
            return None
        if self.lora is None:
            raise APIError(404, f"model '{model}' does not exist; this server serves "
                           f"'{self.model_name}'", "NotFoundError", "model")
        return model

    def resolve_max_tokens(self, requested: int | None, prompt_len: int,
                           prompt_field: str = "prompt") -> int:
        """``max_tokens`` for a prompt: as requested, or all the room left in the context
        (at most the model's default, if its generation config has one), within the
        server's ``max_new_tokens`` cap if its config sets one; an APIError (400)
        when the prompt leaves no room (naming ``prompt_field``) or prompt + max_tokens
        exceeds the context length, in vLLM's (and OpenAI's) words, which clients match to
        trim a conversation."""
        room = self.max_model_len - prompt_len
        if room < 1:
            raise APIError(400, f"This model's maximum context length is {self.max_model_len} "
                           f"tokens. However, your request has {prompt_len} input tokens. "
                           "Please reduce the length of the input.", "BadRequestError",
                           prompt_field)
        if requested is None:
            requested = min(room, self.sampling_defaults.get("max_tokens") or room)
        if requested > room:
            raise APIError(400, f"'max_tokens' is too large: {requested}. This model's maximum "
                           f"context length is {self.max_model_len} tokens and your request "
                           f"has {prompt_len} input tokens ({requested} > "
                           f"{self.max_model_len} - {prompt_len}).", "BadRequestError",
                           "max_tokens")
        return min(requested, self.max_tokens_cap or requested)

    # ---- routes -------------------------------------------------------------------------
    def _install_routes(self) -> None:
        app = self.app
        app.get("/health")(self.health)
        for method in (app.get, app.post):  # vLLM's (SageMaker's) liveness probe
            method("/ping")(self.health)
        app.get("/version")(self.version)
        app.get("/metrics")(self.metrics_endpoint)
        app.get("/v1/models")(self.models)
        app.get("/v1/models/{model_id:path}")(self.model)
        app.post("/tokenize")(self.tokenize)
        app.post("/detokenize")(self.detokenize)
        app.post("/v1/completions")(self.completions)
        app.post("/v1/chat/completions")(self.chat_completions)
        app.post("/v1/responses")(self.responses)
        app.post("/v1/embeddings")(self.embeddings)
        for path in ("/classify", "/v1/classify"):
            app.post(path)(self.classify)
        for path in ("/pooling", "/v1/pooling"):
            app.post(path)(self.pooling)
        for path in ("/score", "/v1/score"):
            app.post(path)(self.score)
        for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
            app.post(path)(self.rerank)
        if self.lora is not None and self.lora.enable_runtime_lora_updating:
            app.post("/v1/load_lora_adapter")(self.load_lora_adapter)
            app.post("/v1/unload_lora_adapter")(self.unload_lora_adapter)

    async def health(self) -> Response:
        """200 while the engine loop is alive and stepping when it has work; 503 (with the
        reason) when it is dead, wedged, restarting, or the server is draining."""
        if self.draining:
            return error_response(503, "shutting down", "ServiceUnavailableError")
        try:
            await self.client.check_health()
        except Exception as err:
            api = api_error_from(err)
            return error_response(503, api.message, "ServiceUnavailableError")
        return Response(status_code=200)

    async def version(self) -> dict:
        return {"version": kvray.__version__}

    async def metrics_endpoint(self) -> Response:
        self.metrics.set_replica_stats(self.client.engine_stats())
        return Response(self.metrics.render(), media_type="text/plain; version=0.0.4")

    async def models(self) -> dict:
        created = now()
        data = [{"id": self.model_name, "object": "model", "created": created,
                 "owned_by": "kvray", "root": self.model_name, "parent": None,
                 "max_model_len": self.max_model_len}]
        if self.lora is not None:
            for name in await self.client.list_loras():
                data.append({"id": name, "object": "model", "created": created,
                             "owned_by": "kvray", "root": name, "parent": self.model_name,
                             "max_model_len": self.max_model_len})
        return {"object": "list", "data": data}

    async def model(self, model_id: str) -> dict:
        """OpenAI's retrieve-model route: the card of the base model or a served adapter
        (``client.models.retrieve``); 404 in OpenAI's shape for any other name."""
        for card in (await self.models())["data"]:
            if card["id"] == model_id:
                return card
        # (the name is not echoed: a path parameter may carry anything)
        raise APIError(404, f"no such model; this server serves '{self.model_name}'"
                       + (" and its LoRA adapters" if self.lora is not None else ""),
                       "NotFoundError", "model")

    async def load_lora_adapter(self, req: LoadLoRAAdapterRequest) -> Response:
        """vLLM's route: read and check the adapter (400 naming why it cannot be served),
        then serve it under ``lora_name``."""
        if req.lora_name == self.model_name:
            raise APIError(400, f"lora_name '{req.lora_name}' is the base model's name",
                           "BadRequestError", "lora_name")
        await self.client.load_lora(req.lora_name, req.lora_path)
        return Response(f"Success: LoRA adapter '{req.lora_name}' added successfully.",
                        media_type="text/plain")

    async def unload_lora_adapter(self, req: UnloadLoRAAdapterRequest) -> Response:
        """Stop serving an adapter (404 if unknown); its requests in flight finish."""
        if not await self.client.unload_lora(req.lora_name):
            raise APIError(404, f"LoRA adapter '{req.lora_name}' is not loaded",
                           "NotFoundError", "lora_name")
        return Response(f"Success: LoRA adapter '{req.lora_name}' removed successfully.",
                        media_type="text/plain")

    async def tokenize(self, req: TokenizeRequest) -> dict:
        self._check_model(req.model)
        if req.messages is not None:
            check_messages(req.messages, self.limits)
            template = self.request_template(req.chat_template)
            conv = conversation_of(req.messages, self.content_format(template))
            ids = await self.off_loop(self.chat_prompt_ids, conv, req.add_generation_prompt,
                                      template_tools(req.tools),
                                      check_template_kwargs(req.chat_template_kwargs),
                                      req.continue_final_message, template)
        elif req.prompt is not None:
            self.check_prompt_text(req.prompt, "prompt")
            ids = (await self.off_loop(lambda: self.tokenizer(
                req.prompt, add_special_tokens=req.add_special_tokens)))["input_ids"]
        else:
            raise APIError(400, "give 'prompt' or 'messages'", "BadRequestError", "prompt")
        out = {"tokens": ids, "count": len(ids), "max_model_len": self.max_model_len}
        if req.return_token_strs:
            out["token_strs"] = await self.off_loop(self.tokenizer.convert_ids_to_tokens, ids)
        return out

    async def detokenize(self, req: DetokenizeRequest) -> dict:
        self._check_model(req.model)
        vocab = len(self.tokenizer)
        if any(not 0 <= t < vocab for t in req.tokens):
            raise APIError(400, f"tokens must be ids in [0, {vocab})", "BadRequestError",
                           "tokens")
        return {"prompt": await self.off_loop(self.tokenizer.decode, req.tokens)}

    def check_prompt_text(self, text: str, param: str) -> None:
        if len(text) > self.limits.max_prompt_chars:
            raise APIError(400, f"{param}: {len(text)} characters; at most "
                           f"{self.limits.max_prompt_chars} allowed", "BadRequestError", param)

    def request_template(self, template: str | None) -> str | None:
        """A request's own ``chat_template``: a 400 unless the server trusts request
        templates (vLLM's rule: a template is code the server runs)."""
        if template is None:
            return None
        if not self.limits.trust_request_chat_template:
            raise APIError(400, "chat_template: a request's own chat template is refused; "
                           "the server runs with trust_request_chat_template off",
                           "BadRequestError", "chat_template")
        return template

    def content_format(self, template: str | None = None) -> str:
        """How message content reaches ``template`` (the model's when None): the server's
        ``chat_template_content_format``, or for ``auto`` what the template reads."""
        fmt = self.limits.chat_template_content_format
        if fmt != "auto":
            return fmt
        if template is None:
            if self._model_content_format is None:
                self._model_content_format = detect_content_format(
                    getattr(self.tokenizer, "chat_template", None))
            return self._model_content_format
        return detect_content_format(template)

    def chat_prompt_ids(self, conv: list[dict], add_generation_prompt: bool,
                        tools: list[dict] | None = None,
                        template_kwargs: dict[str, Any] | None = None,
                        continue_final_message: bool = False,
                        chat_template: str | None = None) -> list[int]:
        """Token ids of a conversation (and the tools offered, if any) through the chat
        template (the request's own ``chat_template`` if it brought one), with the
        request's ``chat_template_kwargs`` (400 if it has none or rejects the messages);
        ``continue_final_message`` leaves the last (assistant) message open."""
        if chat_template is None and not getattr(self.tokenizer, "chat_template", None):
            raise APIError(400, "this model has no chat template; use /v1/completions",
                           "BadRequestError", "messages")
        import jinja2

        own = {"chat_template": chat_template} if chat_template is not None else {}
        try:
            return list(self.tokenizer.apply_chat_template(
                conv, tools=tools or None, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, tokenize=True,
                return_dict=True, **own, **(template_kwargs or {}))["input_ids"])
        except jinja2.TemplateError as err:  # the template rejects these messages
            raise APIError(400, f"the chat template rejected the messages: {err.message}",
                           "BadRequestError", "messages") from None
        except Exception as err:
            logger.warning("chat template failed: %r", err)
            raise APIError(400, "the chat template could not render these messages",
                           "BadRequestError", "messages") from None

    async def completions(self, req: CompletionRequest):
        return await CompletionHandler(self, req, self._check_model(req.model)).run()

    async def chat_completions(self, req: ChatCompletionRequest):
        return await ChatHandler(self, req, self._check_model(req.model)).run()

    async def responses(self, req: ResponsesRequest):
        return await ResponsesHandler(self, req, self._check_model(req.model)).run()

    async def embeddings(self, req: EmbeddingRequest) -> dict:
        return await create_embeddings(self, req, self._check_model(req.model))

    async def classify(self, req: ClassificationRequest) -> dict:
        return await create_classification(self, req, self._check_model(req.model),
                                           self.model_head == "classify")

    async def pooling(self, req: PoolingRequest) -> dict:
        return await create_pooling(self, req, self._check_model(req.model),
                                    self.model_head == "classify")

    async def score(self, req: ScoreRequest) -> dict:
        return await create_scores(self, req, self._check_model(req.model),
                                   self.model_head == "classify")

    async def rerank(self, req: RerankRequest) -> dict:
        return await create_rerank(self, req, self._check_model(req.model),
                                   self.model_head == "classify")

    # ---- shared by handlers -------------------------------------------------------------
    async def stream(self, request_id: str, prompt: Any, params, priority: int
                     ) -> AsyncIterator:
        """The engine's output stream; an error before the first output (invalid request,
        full queue, dead engine) becomes the client's error response. :meth:`abort_all`
        ends every stream with an error."""
        gen = self.client.generate(request_id, prompt, params, priority)
        aborted = self._aborted()
        step: asyncio.Future | None = None
        self.num_in_flight += 1
        try:
            while True:
                step = asyncio.ensure_future(gen.__anext__())
                await asyncio.wait((step, aborted), return_when=asyncio.FIRST_COMPLETED)
                if not step.done():
                    raise APIError(503, "the server shut down before the request finished",
                                   "ServiceUnavailableError", headers={"Retry-After": "5"})
                try:
                    out = step.result()
                except StopAsyncIteration:
                    return
                except Exception as err:
                    raise api_error_from(err) from None
                yield out
        finally:  # finished, failed, aborted, or our consumer went away: stop the engine side
            self.num_in_flight -= 1
            if step is not None and not step.done():
                step.cancel()
                with contextlib.suppress(BaseException):
                    await step
            await gen.aclose()

    def _aborted(self) -> asyncio.Future:
        if self._abort is None:
            self._abort = asyncio.get_running_loop().create_future()
        return self._abort

    def begin_drain(self) -> None:
        """Admit no more requests (503 + Retry-After) and report unhealthy; requests in
        flight go on."""
        self.draining = True

    async def abort_all(self) -> None:
        """End every request in flight with an error (503) and abort it in the engine."""
        self.begin_drain()
        fut = self._aborted()
        if not fut.done():
            fut.set_result(None)

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
        if self.limits.log_requests:
            logger.info("request %s: %d prompt + %d generated tokens, %s, %.3f s",
                        out.request_id, len(out.prompt_token_ids), gen_tokens, reason, e2e)
