"""``POST /v1/responses``: OpenAI's Responses API, the stateless subset, on top of chat
completions.

A request becomes a chat completion request (``instructions`` the system message,
``input`` text or items — messages, earlier ``function_call`` items and their
``function_call_output`` — the conversation; flat function ``tools``; ``text.format`` the
response format; ``max_output_tokens`` the token budget), runs through
:class:`~kvray.serve.completions.ChatHandler` (tool calls, reasoning, structured outputs as
there), and its result comes back as a Response: ``reasoning``, ``message`` and
``function_call`` output items. Streamed, the chat chunks become Responses events
(``response.created`` … ``response.output_text.delta`` … ``response.completed``), each
with its ``sequence_number``.

Stateless: nothing is stored, so ``previous_response_id`` and ``background`` are 400s;
``store`` is accepted and answered ``false``.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import AsyncIterator
from typing import Any

from pydantic import Field, ValidationError

from kvray.serve.completions import ChatHandler, ServerContext
from kvray.serve.http import APIError, streaming_response
from kvray.serve.protocol import ChatCompletionRequest, ProtocolError, _Request, now

# Fields of a Responses request that are not chat fields (everything else a client sends
# beyond them, e.g. vLLM's sampling extras, passes through to the chat request).
_OWN = {"model", "input", "instructions", "max_output_tokens", "temperature", "top_p",
        "tools", "tool_choice", "parallel_tool_calls", "text", "stream", "store",
        "previous_response_id", "background", "reasoning", "metadata", "user", "truncation",
        "include", "service_tier", "prompt_cache_key", "safety_identifier", "max_tool_calls",
        "top_logprobs", "stream_options", "conversation", "prompt"}
_TEXT_PARTS = ("input_text", "output_text", "text")
# A chat field that failed validation, named as this request names it.
_CHAT_TO_OWN = {"messages": "input", "max_completion_tokens": "max_output_tokens",
                "response_format": "text.format"}


def _own_path(param: str) -> str:
    """A nested chat field's path as this request spells it: a tool's fields sit on the
    tool itself (``tools.0.name``, not ``tools.0.function.name``), the schema format's on
    ``text.format``."""
    param = re.sub(r"^(tools\.\d+)\.function(?=\.|$)", r"\1", param)
    return re.sub(r"^response_format\.json_schema(?=\.|$)", "text.format", param)


class ResponsesRequest(_Request):
    """The body of ``POST /v1/responses`` (the fields kvray reads; others are ignored)."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: dict[str, Any] | None = None
    stream: bool = False
    store: bool | None = None
    previous_response_id: str | None = None
    background: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None

    def chat_request(self) -> ChatCompletionRequest:
        """The chat completion request that computes this response (400 naming the field
        of this request that cannot be served)."""
        if self.previous_response_id is not None:
            raise ProtocolError("previous_response_id: this server stores no responses; send "
                                "the whole conversation as input", "previous_response_id")
        if self.background:
            raise ProtocolError("background: not supported; this server answers in the "
                                "request", "background")
        extra = self.model_extra or {}
        if extra.get("conversation") is not None:  # stateful, as previous_response_id
            raise ProtocolError("conversation: this server stores no conversations; send "
                                "the whole conversation as input", "conversation")
        if extra.get("prompt") is not None:  # a stored prompt template: its text is not here
            raise ProtocolError("prompt: stored prompts are not supported; send the text as "
                                "input and instructions", "prompt")
        include = extra.get("include") or []
        if extra.get("top_logprobs") or (isinstance(include, list) and any(
                isinstance(x, str) and "logprobs" in x for x in include)):
            raise ProtocolError("top_logprobs: log-probabilities are not returned by "
                                "/v1/responses here; use /v1/chat/completions", "top_logprobs")
        body: dict[str, Any] = {k: v for k, v in (self.model_extra or {}).items()
                                if k not in _OWN}
        body.update(model=self.model, messages=self._messages(), stream=self.stream,
                    parallel_tool_calls=self.parallel_tool_calls, n=1)
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        for name, value in (("max_completion_tokens", self.max_output_tokens),
                            ("temperature", self.temperature), ("top_p", self.top_p)):
            if value is not None:
                body[name] = value
        if self.tools:
            body["tools"] = [_chat_tool(t, i) for i, t in enumerate(self.tools)]
        if self.tool_choice is not None:
            body["tool_choice"] = _chat_tool_choice(self.tool_choice)
        fmt = (self.text or {}).get("format")
        if fmt is not None:
            body["response_format"] = _chat_format(fmt)
        try:
            return ChatCompletionRequest.model_validate(body)
        except ValidationError as err:
            first = err.errors()[0]
            cause = (first.get("ctx") or {}).get("error")
            if isinstance(cause, ProtocolError):
                raise cause from None
            loc = _own_path(".".join(str(x) for x in first.get("loc", ())))
            param = _CHAT_TO_OWN.get(loc.split(".", 1)[0], loc)
            raise ProtocolError(f"{param}: {first.get('msg', 'invalid')}", param) from None

    def _messages(self) -> list[dict[str, Any]]:
        messages: list[dict[str, Any]] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            messages.append({"role": "user", "content": self.input})
            return messages
        if not self.input:
            raise ProtocolError("input: must not be empty", "input")
        for i, item in enumerate(self.input):
            where = f"input.{i}"
            if not isinstance(item, dict):
                raise ProtocolError(f"{where}: an input item must be an object", where)
            kind = item.get("type", "message" if "role" in item else None)
            if kind == "message":
                role = item.get("role")
                if role not in ("user", "system", "developer", "assistant"):
                    raise ProtocolError(f"{where}.role: must be user, system, developer or "
                                        "assistant", f"{where}.role")
                messages.append({"role": "system" if role == "developer" else role,
                                 "content": _text_of(item.get("content"), f"{where}.content")})
            elif kind == "function_call":
                call = {"id": _string(item, "call_id", where), "type": "function",
                        "function": {"name": _string(item, "name", where),
                                     "arguments": _string(item, "arguments", where)}}
                last = messages[-1] if messages else None
                if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
                    last["tool_calls"].append(call)  # parallel calls: one assistant turn
                else:
                    messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
            elif kind == "function_call_output":
                output = item.get("output")
                if not isinstance(output, str):
                    output = _text_of(output, f"{where}.output")
                messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", where),
                                 "content": output})
            elif kind == "reasoning":
                continue  # earlier reasoning is not sent back to the model
            else:
                raise ProtocolError(f"{where}.type: input item type {kind!r} is not supported "
                                    "(message, function_call, function_call_output)",
                                    f"{where}.type")
        return messages


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise ProtocolError(f"{where}.{key}: must be a string", f"{where}.{key}")
    return value


def _text_of(content: Any, where: str) -> str:
    """A message's content: text, or its text parts one per line, as chat content parts
    are joined (:func:`kvray.inputs.join_text_parts`; other parts are 400s)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ProtocolError(f"{where}: must be a string or a list of content parts", where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise ProtocolError(f"{where}.{j}: content part {kind!r} is not supported; this "
                                "model takes text parts (input_text)", f"{where}.{j}")
        texts.append(part["text"])
    return "\n".join(texts)


def _chat_tool(tool: dict[str, Any], i: int) -> dict[str, Any]:
    where = f"tools.{i}"
    if tool.get("type") != "function":
        raise ProtocolError(f"{where}.type: only function tools are supported (got "
                            f"{tool.get('type')!r})", f"{where}.type")
    spec = {k: tool[k] for k in ("name", "description", "parameters", "strict")
            if tool.get(k) is not None}
    if "name" not in spec:
        raise ProtocolError(f"{where}.name: a function tool needs a name", f"{where}.name")
    return {"type": "function", "function": spec}


def _chat_tool_choice(choice: str | dict[str, Any]) -> Any:
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise ProtocolError("tool_choice: must be auto, none, required or a function",
                                "tool_choice")
        return choice
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
        raise ProtocolError("tool_choice: only {type: function, name} is supported",
                            "tool_choice")
    return {"type": "function", "function": {"name": choice["name"]}}


def _chat_format(fmt: Any) -> dict[str, Any]:
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise ProtocolError("text.format.schema: a json_schema format needs a schema",
                                "text.format.schema")
        return {"type": "json_schema", "json_schema": {
            "name": fmt.get("name"), "schema": fmt["schema"], "strict": fmt.get("strict")}}
    raise ProtocolError("text.format.type: must be text, json_object or json_schema",
                        "text.format.type")


class ResponsesHandler:
    """One ``/v1/responses`` request: its chat completion, returned as a Response."""

    def __init__(self, server: ServerContext, req: ResponsesRequest,
                 lora: str | None = None) -> None:
        self.server, self.req, self.lora = server, req, lora
        self.id = new_id("resp")
        self.created = now()

    async def run(self):
        try:
            chat_req = self.req.chat_request()
        except ProtocolError as err:
            raise APIError(400, str(err), "BadRequestError", err.param) from None
        try:
            chat = ChatHandler(self.server, chat_req, self.lora)
            chat.cached_details = True
            streams, firsts = await chat.submit()
        except APIError as err:  # named as this request names the field
            if err.param is not None:
                own_path = _own_path(err.param)
                if own_path != err.param:
                    err.message = err.message.replace(err.param, own_path)
                    err.param = own_path
                head, _, rest = err.param.partition(".")
                own = {"max_tokens": "max_output_tokens", **_CHAT_TO_OWN}.get(head)
                if own is not None:
                    err.param = f"{own}.{rest}" if rest else own
                    err.message = err.message.replace(head, own, 1)
            raise
        if self.req.stream:
            return streaming_response(self._events(chat.chunks(streams, firsts)))
        finals = await chat.finals(streams)
        return self._from_chat(chat.response(finals))

    # ---- whole responses ------------------------------------------------------------
    def _envelope(self, status: str, output: list[dict], usage: dict | None,
                  incomplete: bool = False) -> dict[str, Any]:
        req = self.req
        fmt = (req.text or {}).get("format") or {"type": "text"}
        return {
            "id": self.id, "object": "response", "created_at": self.created,
            "status": status, "error": None, "background": False,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "model": self.lora or self.server.model_name, "output": output,
            "parallel_tool_calls": req.parallel_tool_calls, "previous_response_id": None,
            "reasoning": None, "store": False,
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "text": {"format": fmt}, "tool_choice": req.tool_choice or "auto",
            "tools": req.tools or [], "top_p": 1.0 if req.top_p is None else req.top_p,
            "truncation": "disabled", "usage": usage, "user": req.user,
            "metadata": req.metadata or {}}

    def _from_chat(self, chat: dict[str, Any]) -> dict[str, Any]:
        choice = chat["choices"][0]
        message = choice["message"]
        output: list[dict[str, Any]] = []
        if message.get("reasoning_content"):  # as streamed: no item for empty reasoning
            output.append(_reasoning_item(new_id("rs"), message["reasoning_content"]))
        if message.get("content") or not message.get("tool_calls"):
            output.append(_message_item(new_id("msg"), message.get("content") or ""))
        for call in message.get("tool_calls") or []:
            fn = call["function"]
            output.append(_call_item(new_id("fc"), call["id"], fn["name"], fn["arguments"]))
        incomplete = choice["finish_reason"] == "length"
        if incomplete:  # the item the limit cut (OpenAI's status for it)
            output[-1]["status"] = "incomplete"
        return self._envelope("incomplete" if incomplete else "completed", output,
                              _usage(chat["usage"]), incomplete)

    # ---- streamed -----------------------------------------------------------------
    async def _events(self, chunks: AsyncIterator[dict]) -> AsyncIterator[str]:
        try:
            async for text in self._translate(chunks):
                yield text
        finally:  # ended, failed or the client went away: the chat stream's requests too
            await chunks.aclose()

    async def _translate(self, chunks: AsyncIterator[dict]) -> AsyncIterator[str]:
        stream = _EventStream()
        yield stream.event("response.created", response=self._envelope("in_progress", [], None))
        yield stream.event("response.in_progress",
                           response=self._envelope("in_progress", [], None))
        finish, usage = None, None
        async for chunk in chunks:
            if "error" in chunk:
                for text in stream.close_item():
                    yield text
                err = chunk["error"]
                yield stream.event("error", code=str(err.get("code")), message=err["message"],
                                   param=err.get("param"))
                failed = self._envelope("failed", stream.output, None)
                failed["error"] = {"code": "server_error", "message": err["message"]}
                yield stream.event("response.failed", response=failed)
                return
            if chunk.get("usage"):
                usage = _usage(chunk["usage"])
            for choice in chunk["choices"]:
                finish = choice.get("finish_reason") or finish
                for text in stream.delta(choice["delta"]):
                    yield text
        if not stream.output and stream.item is None:  # nothing generated: an empty
            # message, as the non-streamed response has
            for text in stream._open(_message_item(new_id("msg"), "")):
                yield text
        incomplete = finish == "length"
        if incomplete and stream.item is not None:  # the item the limit cut
            stream.item["status"] = "incomplete"
        for text in stream.close_item():
            yield text
        done = self._envelope("incomplete" if incomplete else "completed", stream.output,
                              usage, incomplete)
        yield stream.event("response.incomplete" if incomplete else "response.completed",
                           response=done)


class _EventStream:
    """Turns chat deltas into Responses events: one output item open at a time (reasoning,
    then the message, then each function call), each closed with its ``done`` events."""

    def __init__(self) -> None:
        self.seq = 0
        self.output: list[dict[str, Any]] = []  # finished items
        self.item: dict[str, Any] | None = None  # the open item
        self.call_index: int | None = None  # the open function call's chat index

    def event(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n"

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.item["id"], "output_index": len(self.output)}

    def _open(self, item: dict[str, Any]) -> list[str]:
        out = self.close_item()
        self.item = item
        added = {**item, "status": "in_progress"}
        if item["type"] in ("message", "reasoning"):
            added["content"] = []  # its part comes with content_part.added (OpenAI's order)
        out.append(self.event("response.output_item.added", output_index=len(self.output),
                              item=added))
        if item["type"] in ("message", "reasoning"):
            part = {"type": "output_text", "text": "", "annotations": []} \
                if item["type"] == "message" else {"type": "reasoning_text", "text": ""}
            out.append(self.event("response.content_part.added", **self._where(),
                                  content_index=0, part=part))
        return out

    def close_item(self) -> list[str]:
        item, out = self.item, []
        if item is None:
            return out
        where = self._where()
        if item["type"] == "message":
            text = item["content"][0]["text"]
            out.append(self.event("response.output_text.done", **where, content_index=0,
                                  text=text, logprobs=[]))
            out.append(self.event("response.content_part.done", **where, content_index=0,
                                  part=item["content"][0]))
        elif item["type"] == "reasoning":
            text = item["content"][0]["text"]
            out.append(self.event("response.reasoning_text.done", **where, content_index=0,
                                  text=text))
            out.append(self.event("response.content_part.done", **where, content_index=0,
                                  part=item["content"][0]))
        else:
            out.append(self.event("response.function_call_arguments.done", **where,
                                  arguments=item["arguments"], name=item["name"]))
        out.append(self.event("response.output_item.done", output_index=len(self.output),
                              item=item))
        self.output.append(item)
        self.item, self.call_index = None, None
        return out

    def delta(self, delta: dict[str, Any]) -> list[str]:
        out: list[str] = []
        reasoning = delta.get("reasoning_content")
        if reasoning:
            if self.item is None or self.item["type"] != "reasoning":
                out += self._open(_reasoning_item(new_id("rs"), ""))
            self.item["content"][0]["text"] += reasoning
            out.append(self.event("response.reasoning_text.delta", **self._where(),
                                  content_index=0, delta=reasoning))
        content = delta.get("content")
        if content:
            if self.item is None or self.item["type"] != "message":
                out += self._open(_message_item(new_id("msg"), ""))
            self.item["content"][0]["text"] += content
            out.append(self.event("response.output_text.delta", **self._where(),
                                  content_index=0, delta=content, logprobs=[]))
        for call in delta.get("tool_calls") or []:
            fn = call.get("function") or {}
            if call["index"] != self.call_index:  # a new call: its header
                out += self._open(_call_item(new_id("fc"), call.get("id") or "",
                                             fn.get("name") or "", ""))
                self.call_index = call["index"]
            args = fn.get("arguments") or ""
            if args:
                self.item["arguments"] += args
                out.append(self.event("response.function_call_arguments.delta",
                                      **self._where(), delta=args))
        return out


def new_id(prefix: str) -> str:
    """An id as OpenAI shapes Responses ids: ``resp_…``, ``msg_…``, ``fc_…``, ``rs_…``."""
    return f"{prefix}_{uuid.uuid4().hex}"


def _message_item(item_id: str, text: str) -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": "completed", "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [],
                         "logprobs": []}]}


def _reasoning_item(item_id: str, text: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "summary": [], "status": "completed",
            "content": [{"type": "reasoning_text", "text": text}]}


def _call_item(item_id: str, call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name,
            "arguments": arguments, "status": "completed"}


def _usage(chat_usage: dict[str, int]) -> dict[str, Any]:
    return {"input_tokens": chat_usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": (chat_usage.get(
                "prompt_tokens_details") or {}).get("cached_tokens", 0)},
            "output_tokens": chat_usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": chat_usage["total_tokens"]}
