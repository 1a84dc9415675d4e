"""/v1/completions and /v1/chat/completions: turn engine outputs into OpenAI responses,
whole or as Server-Sent Events."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from kvray.serve.openai_app import (
    APIError,
    OpenAIServer,
    gather_outputs,
    sse,
    streaming_response,
)
from kvray.serve.protocol import (
    ProtocolError,
    error_body,
    new_id,
    now,
)


class _Handler:
    object_name = ""
    chunk_name = ""

    def __init__(self, server: OpenAIServer, req: Any) -> None:
        self.server, self.req = server, req
        self.id = new_id(self.id_prefix)
        self.created = now()
        self.start = time.monotonic()
        self.token_times: dict[str, list[float]] = {}
        self.sent: dict[tuple[int, int], tuple[int, int]] = {}  # (prompt, seq) -> chars, toks
        self.finished: set[tuple[int, int]] = set()  # (prompt, seq) whose finish was sent

    def _params(self, prompt_len: int):
        try:
            return self.sampling_params(self.server._max_tokens(self.requested_max_tokens(),
                                                                 prompt_len))
        except ProtocolError as err:
            raise APIError(400, str(err), "BadRequestError", err.param) from None

    def _timed(self, stream: AsyncIterator, key: str) -> AsyncIterator:
        """Record when each output arrives (TTFT / inter-token latency metrics)."""
        times = self.token_times.setdefault(key, [])

        async def gen():
            last = None
            try:
                async for out in stream:
                    if sum(len(c.token_ids) for c in out.outputs) > 0:
                        times.append(time.monotonic())
                    last = out
                    yield out
            finally:  # finished, or the client went away (then the request was aborted)
                if last is not None:
                    self.server.record(last, self.start, times)

        return gen()

    def envelope(self, object_name: str, choices: list[dict], **extra: Any) -> dict:
        """The fields every response and chunk of this request shares."""
        return {"id": self.id, "object": object_name, "created": self.created,
                "model": self.server.model_name, "choices": choices, **extra}

    def delta_chunks(self, i: int, out) -> list[dict]:
        """One chunk per sequence of prompt ``i`` with new text or a new finish reason."""
        chunks = []
        for comp in out.outputs:
            key = (i, comp.index)
            if key in self.finished:
                continue
            chars, toks = self.sent.get(key, (0, 0))
            text = self.full_text(out, comp)
            delta = text[chars:]
            if not delta and comp.finish_reason is None:
                continue
            choice = self.delta_choice(i, comp, delta, toks, chars)
            chunks.append(self.envelope(self.chunk_name, [choice]))
            self.sent[key] = (len(text), len(comp.token_ids))
            if comp.finish_reason is not None:
                self.finished.add(key)
        return chunks

    def usage(self, outs: list) -> dict:
        prompt = sum(len(o.prompt_token_ids) for o in outs)
        completion = sum(len(c.token_ids) for o in outs for c in o.outputs)
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion}

    async def run(self):
        prompts = self.prompt_ids()
        streams = []
        for i, (text, ids) in enumerate(prompts):
            params = self._params(len(ids))
            rid = f"{self.id}-{i}"
            engine_prompt = {"prompt_token_ids": ids, "prompt": text}
            streams.append(self._timed(self.server.stream(rid, engine_prompt, params,
                                                          self.req.priority), rid))
        try:
            firsts = [await s.__anext__() for s in streams]  # a bad request fails here: 400
        except BaseException:
            for s in streams:  # requests already queued for other prompts
                await s.aclose()
            raise
        if self.req.stream:
            return streaming_response(self._sse(streams, firsts))
        finals = await gather_outputs([_prepend(f, s) for f, s in zip(firsts, streams,
                                                                       strict=True)])
        return self.response(finals)

    async def _sse(self, streams, firsts) -> AsyncIterator[str]:
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
        finals: dict[int, Any] = {}
        try:
            for chunk in self.first_chunks():
                yield sse(chunk)
            done = 0
            while done < len(tasks):
                i, out = await queue.get()
                if out is None:
                    done += 1
                    continue
                if isinstance(out, Exception):  # headers are sent: end the stream with it
                    yield sse(error_body(f"request failed: {out}", "InternalServerError", 500))
                    break
                finals[i] = out
                for chunk in self.delta_chunks(i, out):
                    yield sse(chunk)
            opts = self.req.stream_options
            if opts is not None and opts.include_usage:
                yield sse(self.envelope(self.chunk_name, [],
                                        usage=self.usage(list(finals.values()))))
            yield sse("[DONE]")
        finally:
            for t in tasks:  # client gone: cancelling the pumps aborts the requests
                t.cancel()


async def _prepend(first, stream):
    yield first
    async for out in stream:
        yield out


class CompletionHandler(_Handler):
    id_prefix = "cmpl"
    object_name = chunk_name = "text_completion"

    def requested_max_tokens(self):
        return self.req.max_tokens

    def sampling_params(self, max_tokens):
        return self.req.sampling_params(max_tokens, self.req.logprobs)

    def prompt_ids(self) -> list[tuple[str | None, list[int]]]:
        out = []
        try:
            prompts = self.req.prompts()
        except ProtocolError as err:
            raise APIError(400, str(err), "BadRequestError", err.param) from None
        for p in prompts:
            if isinstance(p, str):
                out.append((p, self.server.tokenizer(p)["input_ids"]))
            else:
                out.append((None, list(p)))
            if not out[-1][1]:
                raise APIError(400, "prompt must not be empty", "BadRequestError", "prompt")
        return out

    def _logprobs(self, comp, start_tok: int, text_offset: int) -> dict | None:
        if comp.logprobs is None:
            return None
        tok = self.server.tokenizer
        entries = comp.logprobs[start_tok:]
        ids = comp.token_ids[start_tok:start_tok + len(entries)]
        tokens = [tok.decode([t]) for t in ids]
        offsets, pos = [], text_offset
        for s in tokens:
            offsets.append(pos)
            pos += len(s)
        return {"tokens": tokens, "token_logprobs": [e[t] for t, e in zip(ids, entries,
                                                                            strict=True)],
                "top_logprobs": [{tok.decode([k]): v for k, v in e.items()} for e in entries],
                "text_offset": offsets}

    def response(self, finals) -> dict:
        choices = []
        for i, out in enumerate(finals):
            for comp in out.outputs:
                text = self.full_text(out, comp)
                echo_len = len(text) - len(comp.text)  # offsets count the echoed prompt
                choices.append(self.delta_choice(i, comp, text, 0, echo_len))
        return self.envelope(self.object_name, choices, usage=self.usage(finals))

    def first_chunks(self) -> list[dict]:
        return []

    def full_text(self, out, comp) -> str:
        """The text this choice shows: the completion, after the prompt with ``echo``."""
        if not self.req.echo:
            return comp.text
        prompt = out.prompt if out.prompt is not None else self.server.tokenizer.decode(
            out.prompt_token_ids)
        return prompt + comp.text

    def delta_choice(self, i, comp, text, toks, chars) -> dict:
        return {"index": i * self.req.n + comp.index, "text": text,
                "logprobs": self._logprobs(comp, toks, chars),
                "finish_reason": comp.finish_reason}


class ChatHandler(_Handler):
    id_prefix = "chatcmpl"
    object_name = "chat.completion"
    chunk_name = "chat.completion.chunk"

    def requested_max_tokens(self):
        return self.req.max_completion_tokens or self.req.max_tokens

    def sampling_params(self, max_tokens):
        top = self.req.top_logprobs
        if top is not None and not self.req.logprobs:
            raise ProtocolError("top_logprobs needs logprobs=true", "top_logprobs")
        return self.req.sampling_params(max_tokens, (top or 0) if self.req.logprobs else None)

    def prompt_ids(self) -> list[tuple[str | None, list[int]]]:
        ids = self.server._chat_ids(self.req.conversation(), self.req.add_generation_prompt)
        return [(None, ids)]

    def _logprobs(self, comp, start_tok: int) -> dict | None:
        if comp.logprobs is None:
            return None
        tok = self.server.tokenizer
        k = self.req.top_logprobs or 0
        content = []
        for t, entry in zip(comp.token_ids[start_tok:], comp.logprobs[start_tok:],
                            strict=False):
            s = tok.decode([t])
            top = sorted(((v, i) for i, v in entry.items()), reverse=True)[:k]
            content.append({"token": s, "logprob": entry[t], "bytes": list(s.encode()),
                            "top_logprobs": [{"token": tok.decode([i]), "logprob": v,
                                              "bytes": list(tok.decode([i]).encode())}
                                             for v, i in top]})
        return {"content": content}

    def response(self, finals) -> dict:
        choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                    "logprobs": self._logprobs(c, 0), "finish_reason": c.finish_reason}
                   for c in finals[0].outputs]
        return self.envelope(self.object_name, choices, usage=self.usage(finals))

    def first_chunks(self) -> list[dict]:
        return [self.envelope(self.chunk_name, [{
            "index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
            "finish_reason": None}]) for i in range(self.req.n)]

    def full_text(self, out, comp) -> str:
        return comp.text

    def delta_choice(self, i, comp, text, toks, chars) -> dict:
        return {"index": comp.index, "delta": {"content": text},
                "logprobs": self._logprobs(comp, toks), "finish_reason": comp.finish_reason}
