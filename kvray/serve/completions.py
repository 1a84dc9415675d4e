"""/v1/completions and /v1/chat/completions: turn the engine's delta outputs into OpenAI
responses, whole or as Server-Sent Events.

The engine streams each request as deltas (``RequestOutputKind.DELTA``): only new text,
token ids and logprobs cross from the replica to the ingress, so a stream costs O(its
length). A handler folds the deltas of each prompt into one running total (usage, metrics,
the non-streamed response) and turns each delta into SSE chunks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from kvray.config import ServerConfig
from kvray.outputs import CompletionOutput, RequestOutput
from kvray.sampling_params import ReasoningSpan
from kvray.serve.http import APIError, api_error_from, drain, sse, streaming_response
from kvray.serve.protocol import ProtocolError, error_body, new_id, now
from kvray.serve.reasoning import (
    THINK_END,
    THINK_START,
    ReasoningSplitter,
    prompt_state,
    split_reasoning,
    starts_in_reasoning,
)
from kvray.serve.tools import (
    ToolCallStreamer,
    keeps_special_tokens,
    parse_tool_calls,
    pick_parser,
)

Logprobs = list[dict[int, float]] | None
T = TypeVar("T")


class ServerContext(Protocol):
    """What a handler uses of the server it runs in (the OpenAI app's server is one)."""

    model_name: str
    max_model_len: int
    eos_token_ids: tuple[int, ...]  # the ids that end a sequence (beam search)
    limits: ServerConfig  # bounds every request
    tokenizer: Any  # the model's Hugging Face tokenizer
    sampling_defaults: dict[str, Any]  # the model's own, for unset sampling fields

    async def off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """Run tokenizer work off the event loop."""

    def resolve_max_tokens(self, requested: int | None, prompt_len: int,
                           prompt_field: str = "prompt") -> int:
        """``max_tokens`` for a prompt (400 when it does not fit the context)."""

    def check_prompt_text(self, text: str, param: str) -> None:
        """400 when a prompt text is over the length limit."""

    def chat_prompt_ids(self, conv: list[dict], add_generation_prompt: bool,
                        tools: list[dict] | None = None,
                        template_kwargs: dict[str, Any] | None = None,
                        continue_final_message: bool = False,
                        chat_template: str | None = None) -> list[int]:
        """A conversation's token ids through the chat template."""

    def request_template(self, template: str | None) -> str | None:
        """A request's own chat template, if the server takes it (else a 400)."""

    def content_format(self, template: str | None = None) -> str:
        """How message content reaches the template: ``string`` or ``openai``."""

    def stream(self, request_id: str, prompt: Any, params: Any, priority: int
               ) -> AsyncIterator[RequestOutput]:
        """The engine's delta outputs of one request."""

    def record(self, out: RequestOutput, start: float, token_times: list[float]) -> None:
        """Metrics and the log line of a request that ended."""


@dataclass
class _Pending:
    """One choice's tokens not yet sent in a chunk (their text is still held back: a
    possible stop string's start or a partial character), and where the next token's text
    starts for logprob ``text_offset`` (which counts an echoed prompt)."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: Logprobs = None
    text_offset: int = 0
    started: bool = False
    sent_ids: bool = False  # a chunk of this choice carried its token ids already

    def take(self, comp: CompletionOutput) -> tuple[list[int], Logprobs]:
        """Add ``comp``'s new tokens; return all pending ones and forget them."""
        ids, self.token_ids = self.token_ids + comp.token_ids, []
        lps = None
        if comp.logprobs is not None:
            lps, self.logprobs = (self.logprobs or []) + comp.logprobs, []
        return ids, lps

    def keep(self, ids: list[int], lps: Logprobs) -> None:
        """Put back what :meth:`take` returned when no chunk goes out yet."""
        self.token_ids, self.logprobs = ids, lps


class _Handler:
    id_prefix = object_name = chunk_name = ""
    prompt_field = "prompt"  # what a context-length 400 names when the prompt alone is over
    cached_details = False  # usage always reports prefix-cache hits (the Responses API's)

    def __init__(self, server: ServerContext, req: Any, lora: str | None = None) -> None:
        self.server, self.req = server, req
        self.lora = lora  # the LoRA adapter the request names (None: the base model)
        self.id = new_id(self.id_prefix)
        self.created = now()
        self.start = time.monotonic()
        self.totals: dict[int, RequestOutput] = {}  # prompt index -> deltas folded so far
        self.pending: dict[tuple[int, int], _Pending] = {}  # (prompt, choice) -> unsent
        self.prompt_token_ids: dict[int, list[int]] = {}  # prompt index -> as it ran

    def _params(self, prompt_len: int):
        try:
            max_tokens = self.server.resolve_max_tokens(self.requested_max_tokens(), prompt_len,
                                                        self.prompt_field)
            return self.sampling_params(max_tokens)
        except ProtocolError as err:
            raise APIError(400, str(err), "BadRequestError", err.param) from None

    def _track(self, i: int, stream: AsyncIterator[RequestOutput]
               ) -> AsyncIterator[RequestOutput]:
        """Pass prompt ``i``'s deltas through, folding each into ``totals[i]`` and noting
        when tokens arrive (TTFT / inter-token latency); record the request at the end."""
        times: list[float] = []

        async def gen():
            try:
                async for out in stream:
                    out = self.shown(out)
                    if any(c.token_ids for c in out.outputs):
                        times.append(time.monotonic())
                    total = self.totals.setdefault(
                        i, RequestOutput(out.request_id, None, None, None, [], False))
                    total.add(out)
                    yield out
            finally:  # finished, or the client went away (then the request was aborted)
                if i in self.totals:
                    self.server.record(self.totals[i], self.start, times)

        return gen()

    def shown(self, out: RequestOutput) -> RequestOutput:
        """What of an engine output the response shows (all of it, but for echo alone)."""
        return out

    def token_text(self, token_id: int) -> str:
        """How logprobs name a token: its text, or ``token_id:<id>`` when the request asks
        (``return_tokens_as_token_ids``, vLLM's: a token's text can be ambiguous)."""
        if self.req.return_tokens_as_token_ids:
            return f"token_id:{token_id}"
        return self.server.tokenizer.decode([token_id])

    def prompt_logprobs(self, out: RequestOutput) -> list[dict | None] | None:
        """vLLM's ``prompt_logprobs`` field: per prompt token (None for the first) its id
        and the top ``prompt_logprobs`` ids (as strings) -> logprob, rank, decoded token."""
        k = self.req.prompt_logprobs
        if k is None:
            return None
        return [None if entry is None else {
            str(tok): {"logprob": float(lp), "rank": getattr(lp, "rank", None),
                       "decoded_token": self.token_text(tok)}
            for tok, lp in entry.items() if tok == token or _within(lp, k)}
            for token, entry in zip(out.prompt_token_ids or (), out.prompt_logprobs or [],
                                    strict=False)]

    def envelope(self, object_name: str, choices: list[dict], **extra: Any) -> dict:
        """The fields every response and chunk of this request shares."""
        return {"id": self.id, "object": object_name, "created": self.created,
                "model": self.lora or self.server.model_name, "choices": choices, **extra}

    def delta_chunks(self, i: int, out: RequestOutput) -> list[dict]:
        """One chunk per choice of prompt ``i`` with new text or a finish reason."""
        chunks = []
        for comp in out.outputs:
            pend = self.pending.setdefault((i, comp.index), _Pending())
            ids, lps = pend.take(comp)
            prefix, echoed = "", None
            if not pend.started:
                echoed = self.echoed_logprobs(i)
                if echoed is False and comp.finish_reason is None:  # prompt's still coming
                    pend.keep(ids, lps)
                    continue
                pend.started = True
                prefix = self.prefix_text(i)
                pend.text_offset = _offset_after(echoed) if echoed else len(prefix)
            text = prefix + comp.text
            if not text and comp.finish_reason is None:
                pend.keep(ids, lps)
                continue
            choice = self.choice(i, comp, text, ids, lps, pend.text_offset)
            if echoed:
                _prepend_logprobs(choice, echoed)
            if self.req.return_token_ids:
                if not pend.sent_ids:
                    choice.update(self.first_choice_ids(i))
                choice["token_ids"] = ids
                pend.sent_ids = True
            chunks.append(self.envelope(self.chunk_name, [choice]))
            offsets = (choice["logprobs"] or {}).get("text_offset")
            if offsets:  # tokens whose text is still held back count all the same
                pend.text_offset = offsets[-1] + len(choice["logprobs"]["tokens"][-1])
        return chunks

    def echoed_logprobs(self, i: int) -> dict | bool | None:
        """With ``echo`` and ``logprobs``: the echoed prompt's tokens as completions'
        logprobs fields (False while its prompt logprobs have not all arrived); else None."""
        return None

    def choice_usage(self, i: int, index: int) -> dict[str, int]:
        """vLLM's continuous usage: prompt ``i``'s tokens and those of the choice a chunk
        carries (``index``, numbered across prompts as the response numbers them) so far."""
        total = self.totals[i]
        prompt = len(total.prompt_token_ids or ())
        completion = sum(len(c.token_ids) for c in total.outputs
                         if c.index == index % self.req.n)
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion}

    def first_choice_ids(self, i: int) -> dict[str, Any]:
        """With ``return_token_ids``, what a choice's first chunk carries besides its
        token ids (completions: its prompt's ids; chat puts them in the role chunk)."""
        return {}

    def usage(self, outs: list[RequestOutput]) -> dict:
        """OpenAI's usage of the folded outputs; ``prompt_tokens_details.cached_tokens``
        (prefix-cache hits) when the server enables it or ``cached_details`` is set."""
        prompt = sum(len(o.prompt_token_ids or ()) for o in outs)
        completion = sum(len(c.token_ids) for o in outs for c in o.outputs)
        usage: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion,
                                 "total_tokens": prompt + completion}
        if self.cached_details or self.server.limits.enable_prompt_tokens_details:
            usage["prompt_tokens_details"] = {
                "cached_tokens": sum(o.num_cached_tokens or 0 for o in outs)}
        return usage

    async def run(self):
        """The whole response, or a streaming response of SSE chunks."""
        streams, firsts = await self.submit()
        if self.req.stream:
            return streaming_response(self._sse(streams, firsts))
        return self.response(await self.finals(streams))

    async def finals(self, streams) -> list[RequestOutput]:
        """Each prompt's folded output, once all have finished."""
        await drain(streams)
        return [self.totals[i] for i in range(len(streams))]

    async def submit(self) -> tuple[list, list]:
        """Check the request, put its prompts into the engine; their streams and first
        outputs (a bad or refused prompt fails here: 4xx / 503)."""
        self.req.check_limits(self.server.limits, self.num_prompts())  # 400 naming the field
        prompts = await self.server.off_loop(self.prompt_ids)
        streams = []
        for i, (text, ids) in enumerate(prompts):
            kept = self.req.truncated(ids, self.server.max_model_len)
            text, ids = (text, ids) if kept is ids else (None, kept)
            params = self._params(len(ids))
            self.prompt_token_ids[i] = ids
            engine_prompt = {"prompt_token_ids": ids, "prompt": text}
            if self.lora is not None:  # the engine checks it exists (404 if not)
                engine_prompt["lora_name"] = self.lora
            streams.append(self._track(i, self.server.stream(
                f"{self.id}-{i}", engine_prompt, params, self.req.priority)))
        # All prompts enter the engine at once; a bad or refused one fails here (4xx/503).
        firsts = await asyncio.gather(*(s.__anext__() for s in streams),
                                      return_exceptions=True)
        failed = [f for f in firsts if isinstance(f, BaseException)]
        if failed:
            for s in streams:  # requests already queued for other prompts
                await s.aclose()
            raise failed[0]
        return streams, firsts

    async def _sse(self, streams, firsts) -> AsyncIterator[str]:
        async for chunk in self.chunks(streams, firsts):
            yield sse(chunk)
        yield sse("[DONE]")

    async def chunks(self, streams, firsts) -> AsyncIterator[dict]:
        """The stream's chunks as dicts, the usage chunk if asked for last; an error after
        the first output ends it with OpenAI's error body (a dict with ``error``)."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i, first, stream):
            try:
                await queue.put((i, first))
                async for out in stream:
                    await queue.put((i, out))
            except Exception as err:  # surface it to the response instead of hanging
                await queue.put((i, err))
            await queue.put((i, None))

        tasks = [asyncio.create_task(pump(i, f, s))
                 for i, (f, s) in enumerate(zip(firsts, streams, strict=True))]
        opts = self.req.stream_options
        # vLLM's continuous_usage_stats: every chunk carries the usage so far
        running_usage = opts is not None and opts.include_usage and opts.continuous_usage_stats
        try:
            for chunk in self.first_chunks():
                if running_usage:  # nothing generated yet: the prompt alone (vLLM's)
                    prompt = len(self.prompt_token_ids.get(0, ()))
                    chunk["usage"] = {"prompt_tokens": prompt, "completion_tokens": 0,
                                      "total_tokens": prompt}
                yield chunk
            done = 0
            while done < len(tasks):
                i, out = await queue.get()
                if out is None:
                    done += 1
                    continue
                try:
                    if isinstance(out, Exception):
                        raise out
                    chunks = self.delta_chunks(i, out)
                except Exception as err:  # headers are sent: end the stream with it
                    api = api_error_from(err)
                    yield error_body(api.message, api.err_type, api.status, api.param)
                    break
                for chunk in chunks:
                    if running_usage:
                        chunk["usage"] = self.choice_usage(i, chunk["choices"][0]["index"])
                    yield chunk
            if opts is not None and opts.include_usage:
                totals = [self.totals[i] for i in sorted(self.totals)]
                yield self.envelope(self.chunk_name, [], usage=self.usage(totals))
        finally:
            for t in tasks:  # client gone: cancelling the pumps aborts the requests
                t.cancel()


class CompletionHandler(_Handler):
    id_prefix = "cmpl"
    object_name = chunk_name = "text_completion"

    async def run(self):
        if self.req.use_beam_search:
            return await self._beam_search()
        return await super().run()

    async def _beam_search(self):
        """``use_beam_search``: each prompt's ``best_of`` (default ``n``) beams searched
        above the engine (:func:`kvray.engine.beam_search.beam_search_async`), the ``n``
        best returned; streamed, each choice comes whole in one chunk."""
        from kvray.engine.beam_search import BeamSearchParams, beam_search_async

        req = self.req
        req.check_limits(self.server.limits, self.num_prompts())
        prompts = await self.server.off_loop(self.prompt_ids)
        searches = []
        for i, (text, ids) in enumerate(prompts):
            max_tokens = self.server.resolve_max_tokens(req.max_tokens, len(ids))
            try:
                params = BeamSearchParams(beam_width=req.best_of or req.n,
                                          max_tokens=max_tokens, ignore_eos=req.ignore_eos,
                                          length_penalty=req.length_penalty,
                                          early_stopping=req.early_stopping)
            except ValueError as err:
                field = str(err).split(" ", 1)[0]
                param = {"beam_width": "best_of", "max_tokens": "max_tokens"}.get(field, field)
                raise APIError(400, str(err), "BadRequestError", param) from None
            searches.append(beam_search_async(
                self._generate, ids, params, f"{self.id}-{i}", self.server.eos_token_ids,
                prompt=text, tokenizer=self.server.tokenizer, priority=req.priority,
                max_model_len=self.server.max_model_len))
        results = await asyncio.gather(*searches)
        choices = []
        for i, result in enumerate(results):
            prefix = (result.prompt if result.prompt is not None else
                      self.server.tokenizer.decode(result.prompt_token_ids)) if req.echo else ""
            for j, seq in enumerate(result.sequences[:req.n]):
                choices.append({"index": i * req.n + j, "text": prefix + (seq.text or ""),
                                "logprobs": None, "finish_reason": seq.finish_reason,
                                "stop_reason": None})
                if req.return_token_ids:
                    choices[-1].update(prompt_token_ids=list(result.prompt_token_ids),
                                       token_ids=list(seq.token_ids))
        prompt_tokens = sum(len(r.prompt_token_ids) for r in results)
        completion = sum(len(s.token_ids) for r in results for s in r.sequences[:req.n])
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                 "total_tokens": prompt_tokens + completion}
        if not req.stream:
            return self.envelope(self.object_name, choices, usage=usage)

        async def events() -> AsyncIterator[str]:
            for choice in choices:
                yield sse(self.envelope(self.chunk_name, [choice]))
            if req.stream_options is not None and req.stream_options.include_usage:
                yield sse(self.envelope(self.chunk_name, [], usage=usage))
            yield sse("[DONE]")

        return streaming_response(events())

    def _generate(self, request_id: str, prompt: dict, params: Any, priority: int
                  ) -> AsyncIterator[RequestOutput]:
        """The engine stream of one beam's step (with the request's LoRA adapter)."""
        if self.lora is not None:
            prompt = {**prompt, "lora_name": self.lora}
        return self.server.stream(request_id, prompt, params, priority)

    @property
    def echo_only(self) -> bool:
        """``echo`` with ``max_tokens`` 0 (OpenAI's and vLLM's): the prompt alone comes
        back (with its logprobs if asked); the one token run to compute them is dropped."""
        return bool(self.req.echo) and self.req.max_tokens == 0

    def requested_max_tokens(self):
        return 1 if self.echo_only else self.req.max_tokens

    def shown(self, out: RequestOutput) -> RequestOutput:
        if not self.echo_only:
            return out
        return dataclasses.replace(out, outputs=[dataclasses.replace(
            c, text="", token_ids=[], cumulative_logprob=None,
            logprobs=None if c.logprobs is None else [],
            # the hidden token's own finish (an EOS, a stop) is not the response's
            finish_reason=None if c.finish_reason is None else "length", stop_reason=None)
            for c in out.outputs])

    def sampling_params(self, max_tokens):
        # echo with logprobs shows the prompt's tokens' logprobs too, as OpenAI and vLLM do
        wanted = [k for k in (self.req.logprobs if self.req.echo else None,
                              self.req.prompt_logprobs) if k is not None]
        return self.req.sampling_params(max_tokens, self.req.logprobs,
                                        max(wanted) if wanted else None,
                                        defaults=self.server.sampling_defaults)

    def echoed_logprobs(self, i: int) -> dict | bool | None:
        if not self.req.echo or self.req.logprobs is None:
            return None
        total = self.totals[i]
        ids, entries = total.prompt_token_ids or [], total.prompt_logprobs or []
        if len(entries) < len(ids):
            return False
        k = self.req.logprobs
        tokens = [self.token_text(t) for t in ids]
        offsets = list(itertools.accumulate((len(t) for t in tokens), initial=0))[:-1]
        return {"tokens": tokens,
                "token_logprobs": [None if e is None else e.get(t)
                                   for t, e in zip(ids, entries, strict=False)],
                "top_logprobs": [None if e is None else {
                    self.token_text(i): v for i, v in e.items() if i == t or _within(v, k)}
                                 for t, e in zip(ids, entries, strict=False)],
                "text_offset": offsets}

    def num_prompts(self) -> int:
        try:
            n = len(self.req.prompts())
        except ProtocolError as err:
            raise APIError(400, str(err), "BadRequestError", err.param) from None
        cap = self.server.limits.max_prompts_per_request
        if n > cap:
            raise APIError(400, f"prompt: {n} prompts; at most {cap} allowed per request",
                           "BadRequestError", "prompt")
        return n

    def prompt_ids(self) -> list[tuple[str | None, list[int]]]:
        out = []
        for p in self.req.prompts():
            if isinstance(p, str):
                self.server.check_prompt_text(p, "prompt")
                out.append((p, self.server.tokenizer(p)["input_ids"]))
            else:
                out.append((None, list(p)))
            if not out[-1][1]:
                raise APIError(400, "prompt must not be empty", "BadRequestError", "prompt")
        return out

    def prefix_text(self, i: int) -> str:
        """With ``echo``, the prompt shown before the completion."""
        if not self.req.echo:
            return ""
        total = self.totals[i]
        if total.prompt is not None:
            return total.prompt
        return self.server.tokenizer.decode(total.prompt_token_ids)

    def _logprobs(self, ids: list[int], lps: Logprobs, text_offset: int) -> dict | None:
        if lps is None:
            return None
        tokens = [self.token_text(t) for t in ids]
        offsets, pos = [], text_offset
        for s in tokens:
            offsets.append(pos)
            pos += len(s)
        return {"tokens": tokens, "token_logprobs": [e[t] for t, e in zip(ids, lps, strict=True)],
                "top_logprobs": [{self.token_text(k): v for k, v in e.items()} for e in lps],
                "text_offset": offsets}

    def choice(self, i: int, comp: CompletionOutput, text: str, ids: list[int],
               lps: Logprobs, text_offset: int) -> dict:
        return {"index": i * self.req.n + comp.index, "text": text,
                "logprobs": self._logprobs(ids, lps, text_offset),
                "finish_reason": comp.finish_reason, "stop_reason": comp.stop_reason}

    def response(self, finals: list[RequestOutput]) -> dict:
        choices = []
        for i, out in enumerate(finals):
            prefix = self.prefix_text(i)  # logprob offsets count the echoed prompt
            echoed = self.echoed_logprobs(i)
            prompt_lps = self.prompt_logprobs(out)
            start = _offset_after(echoed) if echoed else len(prefix)
            for c in out.outputs:
                choices.append(self.choice(i, c, prefix + c.text, c.token_ids, c.logprobs,
                                           start))
                if echoed:
                    _prepend_logprobs(choices[-1], echoed)
                choices[-1]["prompt_logprobs"] = prompt_lps
                if self.req.return_token_ids:
                    choices[-1].update(prompt_token_ids=list(out.prompt_token_ids or ()),
                                       token_ids=list(c.token_ids))
        return self.envelope(self.object_name, choices, usage=self.usage(finals))

    def first_chunks(self) -> list[dict]:
        return []

    def first_choice_ids(self, i: int) -> dict[str, Any]:
        return {"prompt_token_ids": list(self.prompt_token_ids.get(i, ()))}


def _within(lp: float, k: int) -> bool:
    """Whether a logprob entry is among the top ``k`` (its rank; an entry without one is)."""
    rank = getattr(lp, "rank", None)
    return rank is None or rank <= k


def _offset_after(echoed: dict) -> int:
    """Where the completion's ``text_offset`` goes on after the echoed prompt's tokens: their
    texts' lengths summed (vLLM's running sum over prompt and completion tokens), so the
    offsets never go back whatever the prompt's text looks like next to its tokens'."""
    tokens, offsets = echoed["tokens"], echoed["text_offset"]
    return offsets[-1] + len(tokens[-1]) if tokens else 0


def _prepend_logprobs(choice: dict, echoed: dict) -> None:
    """Put the echoed prompt's logprobs fields before a completion choice's own."""
    own = choice["logprobs"] or {key: [] for key in echoed}
    choice["logprobs"] = {key: echoed[key] + own[key] for key in echoed}


class ChatHandler(_Handler):
    id_prefix = "chatcmpl"
    object_name = "chat.completion"
    chunk_name = "chat.completion.chunk"
    prompt_field = "messages"

    def __init__(self, server: ServerContext, req: Any, lora: str | None = None) -> None:
        super().__init__(server, req, lora)
        try:
            self.tool_mode, self.tool_name = req.tool_mode()
        except ProtocolError as err:
            raise APIError(400, str(err), "BadRequestError", err.param) from None
        self.tool_parser = pick_parser(server.limits.tool_call_parser,
                                       getattr(server.tokenizer, "chat_template", None))
        self.tools = req.tool_dicts()  # qwen3_coder converts arguments by their schema
        self.streamers: dict[int, ToolCallStreamer] = {}  # choice index -> its parser
        parser = server.limits.reasoning_parser
        self.reasoning_parser = parser if parser != "none" else None
        # whether the output starts in reasoning (None: if it opens a block), from the
        # prompt's end; set with the prompt
        self.reasoning_begins: bool | None = False
        self.splitters: dict[int, ReasoningSplitter] = {}  # choice index -> its splitter

    def _finish_reason(self, reason: str | None, made_calls: bool) -> str | None:
        """A finished output that called tools says so (a named function's: "stop", as
        OpenAI does)."""
        if reason == "stop" and made_calls and self.tool_mode in ("auto", "required"):
            return "tool_calls"
        return reason

    def requested_max_tokens(self):
        return self.req.max_completion_tokens or self.req.max_tokens

    def sampling_params(self, max_tokens):
        top = self.req.top_logprobs
        if top is not None and not self.req.logprobs:
            raise ProtocolError("top_logprobs needs logprobs=true", "top_logprobs")
        params = self.req.sampling_params(max_tokens, (top or 0) if self.req.logprobs else None,
                                          self.req.prompt_logprobs,
                                          defaults=self.server.sampling_defaults)
        if self.tool_mode == "auto" and keeps_special_tokens(self.tool_parser):
            params.skip_special_tokens = False  # Mistral's [TOOL_CALLS] / [ARGS] are special
        span = self._reasoning_span()
        if span is not None and params.structured_outputs is not None:
            # the constraint (response_format, or the one tool_choice implies) holds for
            # the answer after the reasoning
            params.structured_outputs = dataclasses.replace(params.structured_outputs,
                                                            reasoning=span)
        return params

    def _reasoning_span(self) -> ReasoningSpan | None:
        """Where this request's reasoning ends, in tokens; None when its output has none."""
        if self.reasoning_parser is None or self.reasoning_begins is False:
            return None
        tok = self.server.tokenizer
        end = tuple(tok.encode(THINK_END, add_special_tokens=False))
        start = tok.encode(THINK_START, add_special_tokens=False)
        if self.reasoning_begins:
            return ReasoningSpan(end, opened=True)
        if len(start) != 1:  # the output cannot open a block in one token: no reasoning
            return None
        return ReasoningSpan(end, start_id=start[0])

    def num_prompts(self) -> int:
        return 1

    def prompt_ids(self) -> list[tuple[str | None, list[int]]]:
        # under tool_choice "none" the template still renders the tools (vLLM's default)
        # unless the server leaves them out
        tools = self.req.tool_dicts() if self.tool_mode != "none" or not \
            self.server.limits.exclude_tools_when_tool_choice_none else None
        template = self.server.request_template(self.req.chat_template)
        ids = self.server.chat_prompt_ids(self.req.conversation(
                                              self.server.content_format(template)),
                                          self.req.add_generation_prompt, tools,
                                          self.req.template_kwargs(),
                                          self.req.continue_final_message, template)
        if self.reasoning_parser is not None:
            tail = self.server.tokenizer.decode(ids[-16:], skip_special_tokens=False)
            self.reasoning_begins = starts_in_reasoning(self.reasoning_parser,
                                                        prompt_state(tail))
        return [(None, ids)]

    def _split(self, index: int, text: str, final: bool) -> tuple[str, str]:
        """(reasoning, answer) deltas of choice ``index``'s new text."""
        if self.reasoning_parser is None:
            return "", text
        splitter = self.splitters.setdefault(index, ReasoningSplitter(self.reasoning_begins))
        reasoning, answer = splitter.feed(text)
        if final:
            more_reasoning, more_answer = splitter.finish()
            reasoning, answer = reasoning + more_reasoning, answer + more_answer
        return (reasoning if self.req.include_reasoning else ""), answer

    def prefix_text(self, i: int) -> str:
        return ""

    def _logprobs(self, ids: list[int], lps: Logprobs) -> dict | None:
        if lps is None:
            return None
        k = self.req.top_logprobs or 0
        content = []
        for t, entry in zip(ids, lps, strict=False):
            s = self.token_text(t)
            top = sorted(((v, i) for i, v in entry.items()), reverse=True)[:k]
            content.append({"token": s, "logprob": entry[t], "bytes": list(s.encode()),
                            "top_logprobs": [{"token": text, "logprob": v,
                                              "bytes": list(text.encode())}
                                             for v, i in top
                                             for text in (self.token_text(i),)]})
        return {"content": content}

    def choice(self, i: int, comp: CompletionOutput, text: str, ids: list[int],
               lps: Logprobs, text_offset: int) -> dict:
        reasoning, text = self._split(comp.index, text, comp.finish_reason is not None)
        if self.tool_mode == "none":
            delta: dict[str, Any] = {"content": text}
            made_calls = False
        else:
            streamer = self.streamers.setdefault(comp.index, ToolCallStreamer(
                self.tool_mode, self.tool_parser, self.tool_name, tools=self.tools))
            parts = streamer.feed(text)
            if comp.finish_reason is not None:
                parts += streamer.finish()
            delta = _merge_deltas(parts)
            made_calls = streamer.made_calls
            if not self.req.parallel_tool_calls and "tool_calls" in delta:
                kept = [e for e in delta["tool_calls"] if e["index"] == 0]  # the first only
                if kept:
                    delta["tool_calls"] = kept
                else:
                    del delta["tool_calls"]
                    delta.setdefault("content", "")
        if reasoning:
            if delta.get("content") == "" and "tool_calls" not in delta:
                del delta["content"]
            # vLLM's field and its older name, which clients (LiteLLM...) still read
            delta = {"reasoning": reasoning, "reasoning_content": reasoning, **delta}
        return {"index": comp.index, "delta": delta, "logprobs": self._logprobs(ids, lps),
                "finish_reason": self._finish_reason(comp.finish_reason, made_calls),
                "stop_reason": comp.stop_reason}

    def _message(self, comp: CompletionOutput) -> tuple[dict, str | None]:
        reasoning, answer = None, comp.text
        if self.reasoning_parser is not None:
            reasoning, answer = split_reasoning(comp.text, self.reasoning_begins)
        content, calls = parse_tool_calls(answer, self.tool_mode, self.tool_parser,
                                          self.tool_name, tools=self.tools)
        if comp.finish_reason == "length" and self.tool_mode in ("required", "named"):
            content, calls = answer, []  # cut off mid-arguments: not a call
        if not self.req.parallel_tool_calls:
            calls = calls[:1]  # OpenAI's promise: at most one call
        if reasoning is not None and content == "":
            content = None  # all thought, no answer (yet)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if reasoning is not None and self.req.include_reasoning:
            message["reasoning"] = message["reasoning_content"] = reasoning  # as deltas
        if calls:
            message["tool_calls"] = [c.to_openai() for c in calls]
        return message, self._finish_reason(comp.finish_reason, bool(calls))

    def echoed_text(self) -> str:
        """With ``echo``, the last message's text when it is the assistant's (vLLM's)."""
        if not self.req.echo or self.req.messages[-1].role != "assistant":
            return ""
        content = self.req.conversation()[-1].get("content")
        return content if isinstance(content, str) else ""

    def response(self, finals: list[RequestOutput]) -> dict:
        choices = []
        echoed = self.echoed_text()
        for c in finals[0].outputs:
            message, finish = self._message(c)
            if echoed:
                message["content"] = echoed + (message["content"] or "")
            choices.append({"index": c.index, "message": message,
                            "logprobs": self._logprobs(c.token_ids, c.logprobs),
                            "finish_reason": finish, "stop_reason": c.stop_reason})
            if self.req.return_token_ids:
                choices[-1]["token_ids"] = list(c.token_ids)
        extra = {}
        if self.req.prompt_logprobs is not None:
            extra["prompt_logprobs"] = self.prompt_logprobs(finals[0])
        if self.req.return_token_ids:
            extra["prompt_token_ids"] = list(finals[0].prompt_token_ids or ())
        return self.envelope(self.object_name, choices, usage=self.usage(finals), **extra)

    def first_chunks(self) -> list[dict]:
        echoed = self.echoed_text()
        extra = {"prompt_token_ids": list(self.prompt_token_ids.get(0, ()))} \
            if self.req.return_token_ids else {}
        return [self.envelope(self.chunk_name, [{
            "index": i, "delta": {"role": "assistant", "content": echoed}, "logprobs": None,
            "finish_reason": None}], **extra) for i in range(self.req.n)]


def _merge_deltas(parts: list[dict]) -> dict:
    """One chat delta from a streamer's pieces: content joined; tool-call entries of one
    call merged (its header first, the arguments appended)."""
    delta: dict[str, Any] = {}
    calls: dict[int, dict] = {}
    for part in parts:
        if "content" in part:
            delta["content"] = delta.get("content", "") + part["content"]
        for entry in part.get("tool_calls", []):
            merged = calls.get(entry["index"])
            if merged is None:
                calls[entry["index"]] = {**entry, "function": dict(entry["function"])}
            else:
                merged["function"]["arguments"] = (merged["function"].get("arguments", "")
                                                   + entry["function"]["arguments"])
    if calls:
        delta["tool_calls"] = [calls[k] for k in sorted(calls)]
    elif "content" not in delta:
        delta["content"] = ""
    return delta
