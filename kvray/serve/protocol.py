"""OpenAI-compatible request and response models (fields and defaults as OpenAI and vLLM
define them) and their translation to :class:`SamplingParams`."""

from __future__ import annotations

import json
import time
import typing
import uuid
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvray.config import ServerConfig
from kvray.errors import InvalidRequestError
from kvray.inputs import TEXT_PART_KEYS, message_content, truncate_prompt
from kvray.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams
from kvray.serve.tools import required_schema

ProtocolError = InvalidRequestError  # a request parameter is invalid (400 naming it)

PRIORITY_MIN, PRIORITY_MAX = -(2**31), 2**31 - 1  # the documented range of `priority`


def find_lone_surrogate(value: Any, path: str = "") -> str | None:
    """The dotted path of the first string (or dict key) in a decoded JSON value holding
    a lone UTF-16 surrogate (``"\\ud800"``: valid JSON, not valid Unicode), else None."""
    stack = [(path, value)]
    while stack:
        where, v = stack.pop()
        if isinstance(v, str):
            if not v.isascii():
                try:
                    v.encode("utf-8")
                except UnicodeEncodeError:
                    return where or "body"
        elif isinstance(v, dict):
            for k, item in v.items():
                sub = f"{where}.{k}" if where else str(k)
                if isinstance(k, str) and not k.isascii():
                    try:
                        k.encode("utf-8")
                    except UnicodeEncodeError:
                        return where or "body"
                stack.append((sub, item))
        elif isinstance(v, list):
            stack.extend((f"{where}.{i}" if where else str(i), item)
                         for i, item in enumerate(v) if not isinstance(item, int | float))
    return None


class _Request(BaseModel):
    # Unknown OpenAI fields are ignored, as vLLM does; inf and NaN are never numbers.
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        where = find_lone_surrogate(data)
        if where is not None:
            raise InvalidRequestError(
                f"{where}: invalid Unicode (a lone surrogate) in a string", where)
        return data

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data: Any) -> Any:
        """An explicit ``null`` for a field that holds no None (``n``, ``stream``, ``echo``,
        penalties...) means the default, as OpenAI's "or null" fields and vLLM's Optional
        ones take it: clients that serialise unset fields as null are common."""
        if not isinstance(data, dict):
            return data
        return {k: v for k, v in data.items()
                if v is not None or k not in cls.model_fields
                or _accepts_none(cls.model_fields[k].annotation)}


def _accepts_none(annotation: Any) -> bool:
    return annotation in (None, Any) or type(None) in typing.get_args(annotation) or (
        typing.get_origin(annotation) is typing.Annotated
        and _accepts_none(typing.get_args(annotation)[0]))


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: free text, any JSON object, or JSON for a schema."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _Sampling(_Request):
    model: str | None = None
    n: int = 1
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    priority: int = Field(0, ge=PRIORITY_MIN, le=PRIORITY_MAX)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # keep the prompt's last k tokens (-1: as many as the context holds)
    truncate_prompt_tokens: int | None = None
    # the top k logprobs of each prompt token, in the response's ``prompt_logprobs``
    prompt_logprobs: int | None = None
    # logprobs name tokens "token_id:<id>" instead of by their text
    return_tokens_as_token_ids: bool | None = None
    # vLLM's: each choice's output token ids (and the prompt's) in the response; streamed,
    # the prompt's with a choice's first chunk and each chunk's new ids with it
    return_token_ids: bool | None = None
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older
    # guided_* fields (one of them per request).
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @model_validator(mode="after")
    def _stream_options_need_a_stream(self) -> _Sampling:
        if self.stream_options is not None and not self.stream:
            raise ProtocolError("stream_options: only with stream true", "stream_options")
        return self

    def structured(self) -> StructuredOutputsParams | None:
        """The request's output constraint, from whichever field gave one; a 400 naming the
        field if it is malformed or more than one field gave one."""
        found: list[tuple[str, dict[str, Any]]] = []
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            found.append(("response_format", {"json_object": True}))
        elif fmt is not None and fmt.type == "json_schema":
            field = "response_format.json_schema.schema"
            if fmt.json_schema is None or fmt.json_schema.json_schema is None:
                raise ProtocolError(f"{field}: response_format of type json_schema needs "
                                    "json_schema.schema", field)
            found.append((field, {"json": fmt.json_schema.json_schema}))
        if self.structured_outputs is not None:
            known = {"json", "regex", "choice", "grammar", "json_object",
                     "disable_any_whitespace"}
            given = {k: v for k, v in self.structured_outputs.items() if v is not None}
            # vLLM's engine-side knobs are accepted and ignored
            unknown = sorted(set(given) - known - {"backend", "disable_fallback",
                                                   "disable_additional_properties",
                                                   "whitespace_pattern"})
            if unknown:
                raise ProtocolError(f"structured_outputs: unknown key(s) {unknown}; known: "
                                    f"{sorted(known)}", "structured_outputs")
            found.append(("structured_outputs",
                          {k: v for k, v in given.items() if k in known}))
        for name, key in (("guided_json", "json"), ("guided_regex", "regex"),
                          ("guided_choice", "choice"), ("guided_grammar", "grammar")):
            if getattr(self, name) is not None:
                found.append((name, {key: getattr(self, name)}))
        if not found:
            return None
        if len(found) > 1:
            names = ", ".join(name for name, _ in found)
            raise ProtocolError(f"{found[1][0]}: give one output constraint per request "
                                f"(got {names})", found[1][0])
        field, spec = found[0]
        try:
            return StructuredOutputsParams(**spec, field=field)
        except (TypeError, ValueError) as err:
            raise ProtocolError(str(err) if str(err).startswith(field) else f"{field}: {err}",
                                field) from None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        prompt_logprobs: int | None = None,
                        defaults: Mapping[str, Any] | None = None) -> SamplingParams:
        """The engine's parameters for this request; outputs stream back as deltas.
        ``defaults``: the model's values (generation_config.json) for fields left unset,
        before OpenAI's."""
        defaults = defaults or {}

        def pick(name: str, fallback: Any) -> Any:
            value = getattr(self, name)
            return value if value is not None else defaults.get(name, fallback)

        bias = None
        if self.logit_bias:
            try:
                bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except ValueError:
                raise ProtocolError("logit_bias keys must be token ids (integers as strings)",
                                    "logit_bias") from None
        structured = self.structured()
        try:
            return SamplingParams(
                n=self.n, temperature=pick("temperature", 1.0), top_p=pick("top_p", 1.0),
                top_k=pick("top_k", -1), min_p=pick("min_p", 0.0),
                repetition_penalty=pick("repetition_penalty", 1.0),
                presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                logit_bias=bias, seed=self.seed, stop=self.stop,
                stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
                max_tokens=max_tokens, min_tokens=self.min_tokens, logprobs=logprobs,
                prompt_logprobs=prompt_logprobs, skip_special_tokens=self.skip_special_tokens,
                include_stop_str_in_output=self.include_stop_str_in_output,
                output_kind=RequestOutputKind.DELTA, structured_outputs=structured,
                bad_words=self.bad_words, allowed_token_ids=self.allowed_token_ids)
        except ValueError as err:
            raise ProtocolError(str(err), str(err).split(" ", 1)[0]) from None

    def truncated(self, ids: list[int], max_model_len: int) -> list[int]:
        """The prompt's ids as ``truncate_prompt_tokens`` keeps them (its last k; -1: the
        last ``max_model_len - 1``, leaving room for one generated token)."""
        k = self.truncate_prompt_tokens
        return ids if k is None else truncate_prompt(ids, k, max_model_len)

    def check_limits(self, limits: ServerConfig, num_prompts: int) -> None:
        """The server's per-request limits on everything but the prompt itself; raises
        :class:`InvalidRequestError` naming the field."""
        if self.n * num_prompts > limits.max_seqs_per_request:
            param = "n" if num_prompts == 1 else "prompt"
            raise ProtocolError(
                f"{param}: n ({self.n}) x prompts ({num_prompts}) = {self.n * num_prompts} "
                f"sequences; this server allows at most {limits.max_seqs_per_request} per "
                "request", param)
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if len(stops) > limits.max_stop:
            raise ProtocolError(f"stop: {len(stops)} stop strings; at most {limits.max_stop} "
                                "allowed", "stop")
        for s in stops:
            if len(s) > limits.max_stop_chars:
                raise ProtocolError(f"stop: a stop string of {len(s)} characters; at most "
                                    f"{limits.max_stop_chars} allowed", "stop")
        ids = self.stop_token_ids or []
        if len(ids) > limits.max_stop_token_ids:
            raise ProtocolError(f"stop_token_ids: {len(ids)} ids; at most "
                                f"{limits.max_stop_token_ids} allowed", "stop_token_ids")
        bias = self.logit_bias or {}
        if len(bias) > limits.max_logit_bias:
            raise ProtocolError(f"logit_bias: {len(bias)} entries; at most "
                                f"{limits.max_logit_bias} allowed", "logit_bias")
        words = self.bad_words or []  # each is tokenized at admission: bounded like them
        if len(words) > limits.max_logit_bias:
            raise ProtocolError(f"bad_words: {len(words)} words; at most "
                                f"{limits.max_logit_bias} allowed", "bad_words")
        for word in words:
            if len(word) > limits.max_stop_chars:
                raise ProtocolError(f"bad_words: a word of {len(word)} characters; at most "
                                    f"{limits.max_stop_chars} allowed", "bad_words")
        k = self.prompt_logprobs
        if k is not None and not 0 <= k <= limits.max_logprobs:
            raise ProtocolError(f"prompt_logprobs = {k}: must be in [0, "
                                f"{limits.max_logprobs}]", "prompt_logprobs")
        if k is not None and self.stream:  # as vLLM: they come with the whole response
            raise ProtocolError("prompt_logprobs: not available with stream true",
                                "prompt_logprobs")


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    # beam search (vLLM's extras): best_of beams (default n), the n best returned
    use_beam_search: bool = False
    best_of: int | None = None
    length_penalty: float = 1.0
    early_stopping: bool | Literal["never"] = False

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise ProtocolError("prompt must not be empty", "prompt")
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)

    def check_limits(self, limits: ServerConfig, num_prompts: int) -> None:
        super().check_limits(limits, num_prompts)
        if self.suffix:  # text after the insertion point: not a plain continuation
            raise ProtocolError("suffix: not supported; this server only continues the "
                                "prompt", "suffix")
        cap = limits.max_logprobs  # (OpenAI caps at 5, vLLM at max_logprobs)
        if self.logprobs is not None and not 0 <= self.logprobs <= cap:
            raise ProtocolError(f"logprobs = {self.logprobs}: must be in [0, {cap}]",
                                "logprobs")
        if self.best_of is not None and (self.best_of < self.n or (
                self.best_of > self.n and not self.use_beam_search)):
            # best_of == n is OpenAI's default, nothing to do
            raise ProtocolError(f"best_of = {self.best_of}: must be >= n ({self.n}), and "
                                "more than n only with use_beam_search", "best_of")
        if self.use_beam_search:
            width = self.best_of or self.n
            if width * num_prompts > limits.max_seqs_per_request:
                raise ProtocolError(f"best_of: {width} beams x {num_prompts} prompts; this "
                                    f"server allows at most {limits.max_seqs_per_request} "
                                    "sequences per request", "best_of")
            for name in ("logprobs", "logit_bias", "response_format", "structured_outputs",
                         "guided_json", "guided_regex", "guided_choice", "guided_grammar"):
                if getattr(self, name) is not None:
                    raise ProtocolError(f"{name}: not supported with use_beam_search", name)
            if self.stop or self.stop_token_ids or self.min_tokens:
                name = "stop" if self.stop else (
                    "stop_token_ids" if self.stop_token_ids else "min_tokens")
                raise ProtocolError(f"{name}: not supported with use_beam_search", name)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool's result answers this call
    name: str | None = None


class FunctionDefinition(BaseModel):
    name: str = Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class _FunctionName(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: _FunctionName


class _OpenEnd(BaseModel):
    """How a conversation's prompt ends: the assistant's turn opened
    (``add_generation_prompt``), or its last message left open to be continued
    (``continue_final_message``, vLLM's prefill of the answer), or neither."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False

    @model_validator(mode="after")
    def _one_open_end(self) -> _OpenEnd:
        if not self.continue_final_message:
            return self
        if self.add_generation_prompt:
            raise ProtocolError("continue_final_message: cannot be combined with "
                                "add_generation_prompt (set it to false)",
                                "continue_final_message")
        messages = getattr(self, "messages", None)
        if messages and messages[-1].role != "assistant":
            raise ProtocolError("continue_final_message: the last message must be the "
                                "assistant's, to be continued", "continue_final_message")
        return self


class ChatCompletionRequest(_Sampling, _OpenEnd):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    # vLLM extras: variables for the chat template (``enable_thinking``...), and whether a
    # reasoning parser's reasoning_content is returned
    chat_template_kwargs: dict[str, Any] | None = None
    include_reasoning: bool = True
    # vLLM's: the reply starts with the last message's text when that is the assistant's
    # (with continue_final_message, the whole turn comes back)
    echo: bool = False
    # vLLM's: a template for this request (the server must trust request templates)
    chat_template: str | None = None

    def tool_mode(self) -> tuple[str, str | None]:
        """(``none`` | ``auto`` | ``required`` | ``named``, the named function's name)."""
        choice = self.tool_choice
        if not self.tools:  # "auto" over no tools is plain chat (vLLM's; clients send it)
            if choice not in (None, "none", "auto"):
                raise ProtocolError("tool_choice: needs tools", "tool_choice")
            return "none", None
        if isinstance(choice, NamedToolChoice):
            names = [t.function.name for t in self.tools]
            if choice.function.name not in names:
                raise ProtocolError(f"tool_choice: no tool named {choice.function.name!r} in "
                                    f"tools ({', '.join(names)})", "tool_choice")
            return "named", choice.function.name
        return choice or "auto", None

    def tool_dicts(self) -> list[dict[str, Any]]:
        """The tools as chat templates take them."""
        return template_tools(self.tools)

    def structured(self) -> StructuredOutputsParams | None:
        """A constraint from response_format and friends, or the one tool_choice implies
        (``required``: an array of calls; a named function: its parameters), not both."""
        own = super().structured()
        mode, name = self.tool_mode()
        if mode not in ("required", "named"):
            return own
        if own is not None:
            raise ProtocolError(f"tool_choice: {mode} tool calls constrain the output "
                                f"already; drop {own.field}", "tool_choice")
        functions = [t.function.model_dump(exclude_none=True) for t in self.tools]
        if mode == "named":
            spec = next(f for f in functions if f["name"] == name)
            schema = spec.get("parameters") or {"type": "object"}
        else:
            schema = required_schema(functions, self.parallel_tool_calls)
        try:
            return StructuredOutputsParams(json=schema, field="tools")
        except ValueError as err:
            raise ProtocolError(str(err), "tools") from None

    def template_kwargs(self) -> dict[str, Any]:
        return check_template_kwargs(self.chat_template_kwargs)

    def conversation(self, content_format: str = "string") -> list[dict[str, Any]]:
        """The messages as the chat template takes them (:func:`conversation_of`)."""
        return conversation_of(self.messages, content_format)

    def check_limits(self, limits: ServerConfig, num_prompts: int) -> None:
        super().check_limits(limits, num_prompts)
        top = self.top_logprobs
        if top is not None and not 0 <= top <= limits.max_logprobs:
            raise ProtocolError(f"top_logprobs = {top}: must be in [0, {limits.max_logprobs}]",
                                "top_logprobs")
        check_messages(self.messages, limits)
        self.template_kwargs()


def conversation_of(messages: list[ChatMessage], content_format: str = "string"
                    ) -> list[dict[str, Any]]:
    """The messages as vLLM hands them to a chat template: content as the template's
    ``content_format`` takes it (``string``: text parts joined; ``openai``: a list of text
    parts; any other part, image or audio, is a 400: this server runs text models), earlier
    tool calls with their arguments as objects, and an assistant's earlier reasoning under
    both of vLLM's names (interleaved-thinking templates render it)."""
    out = []
    for i, m in enumerate(messages):
        content = message_content(m.content, content_format, f"messages.{i}.content")
        entry: dict[str, Any] = {"role": m.role, "content": content}
        if m.tool_calls:
            entry["tool_calls"] = [_template_call(c, f"messages.{i}.tool_calls.{j}")
                                   for j, c in enumerate(m.tool_calls)]
        if m.tool_call_id is not None:
            entry["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            entry["name"] = m.name
        extra = m.model_extra or {}
        reasoning = extra.get("reasoning") or extra.get("reasoning_content")
        if m.role == "assistant" and isinstance(reasoning, str):
            entry["reasoning"] = entry["reasoning_content"] = reasoning
        out.append(entry)
    return out


def template_tools(tools: list[ChatTool] | None) -> list[dict[str, Any]]:
    """Tools as vLLM hands them to a chat template: each function's ``description`` and
    ``parameters`` always present (null when unset; templates that ``tojson`` a tool render
    them), ``strict`` only when the request set it."""
    out = []
    for tool in tools or []:
        fn = tool.function.model_dump()
        if "strict" not in tool.function.model_fields_set:
            fn.pop("strict")
        out.append({"type": tool.type, "function": fn})
    return out


def _template_call(call: dict[str, Any], where: str) -> dict[str, Any]:
    """An earlier tool call as chat templates take it: OpenAI sends ``arguments`` as JSON
    text, templates (Qwen's, Llama's) render them as an object."""
    fn = call.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ProtocolError(f"{where}.function: needs a name", f"{where}.function")
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            raise ProtocolError(f"{where}.function.arguments: not valid JSON",
                                f"{where}.function.arguments") from None
    return {**call, "type": call.get("type", "function"),
            "function": {"name": fn["name"], "arguments": args}}


# What the server passes to the chat template itself: a request cannot override these.
_TEMPLATE_OWN = frozenset({"messages", "conversation", "tools", "documents",
                           "add_generation_prompt", "continue_final_message", "tokenize",
                           "return_dict", "return_tensors", "chat_template", "tokenizer",
                           "padding", "truncation", "max_length", "return_assistant_tokens_mask"})


def check_template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """``chat_template_kwargs`` as the template takes them: string keys naming template
    variables, none of the arguments the server sets itself (a 400 naming the key)."""
    if not kwargs:
        return {}
    for key in kwargs:
        if not key.isidentifier():
            raise ProtocolError(f"chat_template_kwargs.{key}: not a template variable name",
                                f"chat_template_kwargs.{key}")
        if key in _TEMPLATE_OWN:
            raise ProtocolError(f"chat_template_kwargs.{key}: set by the server; give it as "
                                "a request field instead", f"chat_template_kwargs.{key}")
    return dict(kwargs)


def check_messages(messages: list[ChatMessage], limits: ServerConfig) -> None:
    """Message count and total content size within the server's limits."""
    if len(messages) > limits.max_messages:
        raise ProtocolError(f"messages: {len(messages)} messages; at most "
                            f"{limits.max_messages} allowed", "messages")
    total = 0
    for m in messages:
        if isinstance(m.content, str):
            total += len(m.content)
        elif isinstance(m.content, list):  # the text each part carries (a text, a
            # refusal...) and the line breaks that join them
            for p in m.content:
                kind = p.get("type")
                text = p.get(TEXT_PART_KEYS.get(kind, "text") if isinstance(kind, str)
                             else "text")
                total += len(text) if isinstance(text, str) else 0
            total += max(len(m.content) - 1, 0)
    if total > limits.max_prompt_chars:
        raise ProtocolError(f"messages: {total} characters of content; at most "
                            f"{limits.max_prompt_chars} allowed", "messages")


class TokenizeRequest(_Request, _OpenEnd):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatTool] | None = None  # rendered by the template, as chat's are
    chat_template: str | None = None
    return_token_strs: bool = False  # vLLM's: each id's token string, in token_strs


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


class LoadLoRAAdapterRequest(_Request):
    """vLLM's ``POST /v1/load_lora_adapter`` body."""

    lora_name: str = Field(min_length=1, max_length=128)
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLoRAAdapterRequest(_Request):
    """vLLM's ``POST /v1/unload_lora_adapter`` body (``lora_int_id`` accepted, unused)."""

    lora_name: str = Field(min_length=1, max_length=128)
    lora_int_id: int | None = None


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def error_body(message: str, err_type: str, code: int, param: str | None = None
               ) -> dict[str, Any]:
    """OpenAI's error JSON shape."""
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}

