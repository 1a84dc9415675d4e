"""``/v1/embeddings``, ``/classify``, ``/score`` and ``/rerank``: pooling requests through
the same engine (prefill only; see :class:`~kvray.sampling_params.PoolingParams`).

- ``/v1/embeddings`` (OpenAI's): ``input`` a text, texts, token ids or lists of them;
  ``encoding_format`` float or base64 (little-endian float32, as OpenAI's client decodes
  it); ``dimensions`` keeps the first values, normalised again (Matryoshka).
- ``/classify`` (vLLM's): each input's class probabilities from a classifier's head, with
  the likeliest class's name (``id2label``).
- ``/score`` (vLLM's: ``text_1`` against each ``text_2``, or pairwise when both are lists;
  also named ``data_1`` / ``data_2`` or ``queries`` / ``documents``)
  and ``/rerank`` (Jina / Cohere's: ``query`` against ``documents``, best first, ``top_n``):
  on a ``*ForSequenceClassification`` model (a cross-encoder) the score is the head's logit
  for the pair encoded as the tokenizer pairs texts, through the model's activation (a
  reranker's sigmoid, as vLLM and sentence-transformers give it); on an embedding model,
  the cosine similarity of the two embeddings.
"""

from __future__ import annotations

import asyncio
import base64
import struct
from typing import Any, Literal

from pydantic import AliasChoices, Field

from kvray.errors import InvalidRequestError
from kvray.inputs import score_pairs, truncate_prompt
from kvray.models.pooling import cosine_similarity
from kvray.outputs import RequestOutput
from kvray.sampling_params import PoolingParams, RequestOutputKind, SamplingParams
from kvray.serve.completions import ServerContext
from kvray.serve.http import APIError, api_error_from
from kvray.serve.protocol import (
    PRIORITY_MAX,
    PRIORITY_MIN,
    ChatMessage,
    _OpenEnd,
    _Request,
    check_messages,
    check_template_kwargs,
    conversation_of,
    new_id,
    now,
)

Prompt = str | list[int]
POOLING_TASK_NAMES = Literal["embed", "classify", "token_embed", "token_classify"]


class _PoolingRequest(_Request):
    """What every pooling route takes besides its texts: the prompt's truncation,
    ``use_activation`` (vLLM's newer name for normalising an embedding or activating
    class logits) and the priority."""

    model: str | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = None
    use_activation: bool | None = None
    priority: int = Field(0, ge=PRIORITY_MIN, le=PRIORITY_MAX)


class _PoolingInputs(_PoolingRequest, _OpenEnd):
    """Inputs as vLLM's pooling routes take them: ``input`` (a text, texts, token ids or
    lists of them), or ``messages``, one conversation rendered by the chat template
    (without the assistant's turn opened unless ``add_generation_prompt``)."""

    input: str | list[str] | list[int] | list[list[int]] | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = False
    add_special_tokens: bool | None = None  # None: True for input, False for messages
    chat_template_kwargs: dict[str, Any] | None = None


class EmbeddingRequest(_PoolingInputs):
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    normalize: bool | None = None  # older vLLM's: None = the model's choice


class ClassificationRequest(_PoolingInputs):
    activation: bool = True  # older vLLM's: False returns the raw logits as "probs"


class PoolingRequest(_PoolingInputs):
    """vLLM's ``/pooling``: the pooling result of ``task`` (default: the model's own,
    ``classify`` for a classifier, else ``embed``); the token tasks give one row per
    prompt token."""

    task: POOLING_TASK_NAMES | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)


class ScoreRequest(_PoolingRequest):
    # vLLM's names over its versions: text_1 / text_2, data_1 / data_2, queries / documents
    text_1: str | list[str] = Field(validation_alias=AliasChoices("text_1", "data_1",
                                                                  "queries"))
    text_2: str | list[str] = Field(validation_alias=AliasChoices("text_2", "data_2",
                                                                  "documents"))


class RerankRequest(_PoolingRequest):
    query: str
    documents: list[str | dict[str, Any]] = Field(min_length=1)
    top_n: int | None = Field(None, ge=0)  # None or 0: every document (vLLM's)
    return_documents: bool = True


class PoolingHandler:
    """Runs a request's prompts as pooling requests, all at once, and gathers their
    vectors (a refused or invalid prompt is the whole request's 4xx, naming ``field``)."""

    def __init__(self, server: ServerContext, lora: str | None, req: _PoolingRequest,
                 prefix: str = "embd") -> None:
        self.server, self.lora, self.req = server, lora, req
        self.id = new_id(prefix)

    def check_prompts(self, prompts: list[Prompt], field: str) -> None:
        limits = self.server.limits
        if not prompts:
            raise APIError(400, f"{field}: must not be empty", "BadRequestError", field)
        if len(prompts) > limits.max_prompts_per_request:
            raise APIError(400, f"{field}: {len(prompts)} inputs; at most "
                           f"{limits.max_prompts_per_request} allowed per request",
                           "BadRequestError", field)
        for p in prompts:
            if isinstance(p, str):
                self.server.check_prompt_text(p, field)
            if len(p) == 0:
                raise APIError(400, f"{field}: an input must not be empty",
                               "BadRequestError", field)

    async def inputs(self) -> list[Prompt]:
        """The request's prompts: its ``input`` (checked), or its conversation's ids."""
        req = self.req
        assert isinstance(req, _PoolingInputs)
        if (req.input is None) == (req.messages is None):
            raise APIError(400, "give exactly one of 'input' and 'messages'",
                           "BadRequestError", "input")
        if req.input is not None:
            prompts = _inputs(req.input)
            self.check_prompts(prompts, "input")
            return prompts
        if req.add_special_tokens:
            raise APIError(400, "add_special_tokens: the chat template adds a "
                           "conversation's special tokens; it cannot be true with messages",
                           "BadRequestError", "add_special_tokens")
        check_messages(req.messages, self.server.limits)
        conv = conversation_of(req.messages, self.server.content_format())
        ids = await self.server.off_loop(
            self.server.chat_prompt_ids, conv, req.add_generation_prompt, None,
            check_template_kwargs(req.chat_template_kwargs), req.continue_final_message)
        return [ids]

    async def pool(self, prompts: list[Prompt | tuple[str, str]], pooling: PoolingParams,
                   field: str) -> list[RequestOutput]:
        """Each prompt's final output (``pooled`` set); a text pair is encoded as the
        tokenizer pairs texts, then truncated as the request asks."""
        ids = await self.server.off_loop(self._token_ids, prompts)
        params = SamplingParams(max_tokens=1, pooling=pooling,
                                output_kind=RequestOutputKind.FINAL_ONLY)
        max_len = self.server.max_model_len
        keep = self.req.truncate_prompt_tokens
        if keep is not None:
            try:
                ids = [truncate_prompt(prompt_ids, keep, max_len, generates=False)
                       for prompt_ids in ids]
            except InvalidRequestError as err:
                raise api_error_from(err) from None
        for prompt_ids in ids:
            if len(prompt_ids) > max_len:
                raise APIError(400, f"{field}: this model's maximum context length is "
                               f"{max_len} tokens. However, an input has {len(prompt_ids)} "
                               "tokens. Please reduce the length of the input, or set "
                               "truncate_prompt_tokens.", "BadRequestError", field)
        return await asyncio.gather(*(self._one(f"{self.id}-{i}", prompt_ids, params, field)
                                      for i, prompt_ids in enumerate(ids)))

    def _token_ids(self, prompts: list[Prompt | tuple[str, str]]) -> list[list[int]]:
        tok = self.server.tokenizer
        special = getattr(self.req, "add_special_tokens", None) is not False
        out = []
        for p in prompts:
            if isinstance(p, tuple):
                out.append(list(tok(p[0], text_pair=p[1],
                                    add_special_tokens=special)["input_ids"]))
            elif isinstance(p, str):
                out.append(list(tok(p, add_special_tokens=special)["input_ids"]))
            else:
                out.append(list(p))
        return out

    async def _one(self, request_id: str, ids: list[int], params: SamplingParams,
                   field: str) -> RequestOutput:
        prompt: dict[str, Any] = {"prompt_token_ids": ids}
        if self.lora is not None:
            prompt["lora_name"] = self.lora
        final = None
        try:
            async for out in self.server.stream(request_id, prompt, params,
                                                self.req.priority):
                final = out
        except APIError as err:
            if err.param in ("prompt", "prompt_token_ids"):  # named as the request names it
                err.param = field
            raise
        except Exception as err:
            raise api_error_from(err) from None
        if final is None or final.pooled is None:
            raise APIError(503, "the request ended before its vector was computed",
                           "ServiceUnavailableError", headers={"Retry-After": "1"})
        return final

    def usage(self, outs: list[RequestOutput]) -> dict[str, int]:
        tokens = sum(len(o.prompt_token_ids or ()) for o in outs)
        return {"prompt_tokens": tokens, "total_tokens": tokens}


async def create_embeddings(server: ServerContext, req: EmbeddingRequest,
                            lora: str | None) -> dict[str, Any]:
    handler = PoolingHandler(server, lora, req)
    prompts = await handler.inputs()
    normalize = req.normalize if req.use_activation is None else req.use_activation
    outs = await handler.pool(prompts, PoolingParams(dimensions=req.dimensions,
                                                     normalize=normalize), "input")
    data = [{"object": "embedding", "index": i,
             "embedding": _encode(out.pooled, req.encoding_format)}
            for i, out in enumerate(outs)]
    return {"id": handler.id, "object": "list", "created": now(),
            "model": lora or server.model_name, "data": data, "usage": handler.usage(outs)}


async def create_classification(server: ServerContext, req: ClassificationRequest,
                                lora: str | None, classify: bool) -> dict[str, Any]:
    """vLLM's ``/classify``: each input's class probabilities (the model's activation of
    its head's logits) and the likeliest class's name."""
    if not classify:
        raise APIError(400, "this model has no classification head; /classify needs a "
                       "*ForSequenceClassification model", "BadRequestError", "model")
    handler = PoolingHandler(server, lora, req, "classify")
    prompts = await handler.inputs()
    activation = req.activation if req.use_activation is None else req.use_activation
    outs = await handler.pool(prompts, PoolingParams(task="classify", activation=activation),
                              "input")
    labels = getattr(server, "model_labels", ())
    data = []
    for i, out in enumerate(outs):
        best = max(range(len(out.pooled)), key=out.pooled.__getitem__)
        data.append({"index": i, "label": labels[best] if best < len(labels)
                     else f"LABEL_{best}", "probs": out.pooled,
                     "num_classes": len(out.pooled)})
    usage = handler.usage(outs)
    return {"id": handler.id, "object": "list", "created": now(),
            "model": lora or server.model_name, "data": data,
            "usage": {**usage, "completion_tokens": 0}}


async def create_pooling(server: ServerContext, req: PoolingRequest, lora: str | None,
                         classify: bool) -> dict[str, Any]:
    """vLLM's ``/pooling``: each input's pooling result as ``data`` (a vector, or one row
    per prompt token for the token tasks; base64: the float32 values row after row)."""
    task = req.task or ("classify" if classify else "embed")
    if task in ("classify", "token_classify") and not classify:
        raise APIError(400, f"task {task}: this model has no classification head (a "
                       "*ForSequenceClassification model has one)", "BadRequestError", "task")
    handler = PoolingHandler(server, lora, req, "pool")
    prompts = await handler.inputs()
    try:
        pooling = PoolingParams(task=task, dimensions=req.dimensions,
                                use_activation=req.use_activation)
    except ValueError as err:  # "<field> = <value>: <rule>"
        raise APIError(400, str(err), "BadRequestError", str(err).split(" ", 1)[0]) from None
    outs = await handler.pool(prompts, pooling, "input")
    data = [{"index": i, "object": "pooling", "data": _encode(out.pooled, req.encoding_format)}
            for i, out in enumerate(outs)]
    return {"id": handler.id, "object": "list", "created": now(),
            "model": lora or server.model_name, "data": data, "usage": handler.usage(outs)}


def _inputs(value: Any) -> list[Prompt]:
    if isinstance(value, str):
        return [value]
    if value and all(isinstance(x, int) for x in value):
        return [list(value)]
    return list(value)


def _encode(vector: list[float] | list[list[float]], encoding: str
            ) -> list[float] | list[list[float]] | str:
    """``float``: as it is; ``base64``: little-endian float32 values (rows one after
    another), as OpenAI's client decodes them."""
    if encoding == "float":
        return vector
    flat = [x for row in vector for x in row] if vector and isinstance(vector[0], list) \
        else vector
    return base64.b64encode(struct.pack(f"<{len(flat)}f", *flat)).decode()


async def _scores(server: ServerContext, handler: PoolingHandler, pairs: list[tuple[str, str]],
                  classify: bool, field: str) -> tuple[list[float], list[RequestOutput]]:
    """One score per (a, b) pair: the classification head's activated logit, or the
    cosine similarity of the two texts' embeddings (an input too long: a 400 naming
    ``field``, the second texts', usually the long ones)."""
    if classify:
        outs = await handler.pool(pairs, PoolingParams(
            task="classify", use_activation=handler.req.use_activation), field)
        for out in outs:
            if len(out.pooled) != 1:
                raise APIError(400, f"this model has {len(out.pooled)} labels; scores need a "
                               "model with one (a reranker)", "BadRequestError", "model")
        return [out.pooled[0] for out in outs], outs
    texts = sorted({t for pair in pairs for t in pair})
    outs = await handler.pool(texts, PoolingParams(normalize=False), field)
    vectors = dict(zip(texts, (o.pooled for o in outs), strict=True))
    return [cosine_similarity(vectors[a], vectors[b]) for a, b in pairs], outs


async def create_scores(server: ServerContext, req: ScoreRequest, lora: str | None,
                        classify: bool) -> dict[str, Any]:
    handler = PoolingHandler(server, lora, req, "score")
    for texts, field in ((req.text_1, "text_1"), (req.text_2, "text_2")):
        handler.check_prompts([texts] if isinstance(texts, str) else texts, field)
    try:
        pairs = score_pairs(req.text_1, req.text_2, ("text_1", "text_2"))
    except ValueError as err:
        raise APIError(400, str(err), "BadRequestError", "text_2") from None
    scores, outs = await _scores(server, handler, pairs, classify, "text_2")
    return {"id": handler.id, "object": "list", "created": now(),
            "model": lora or server.model_name,
            "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
            "usage": handler.usage(outs)}


async def create_rerank(server: ServerContext, req: RerankRequest, lora: str | None,
                        classify: bool) -> dict[str, Any]:
    docs = []
    for i, doc in enumerate(req.documents):
        text = doc if isinstance(doc, str) else doc.get("text")
        if not isinstance(text, str):
            raise APIError(400, f"documents.{i}: a document is a string or {{'text': ...}}",
                           "BadRequestError", f"documents.{i}")
        docs.append(text)
    handler = PoolingHandler(server, lora, req, "rerank")
    handler.check_prompts([req.query], "query")
    handler.check_prompts(docs, "documents")
    scores, outs = await _scores(server, handler, [(req.query, d) for d in docs], classify,
                                 "documents")
    order = sorted(range(len(docs)), key=lambda i: -scores[i])[:req.top_n or len(docs)]
    results = []
    for i in order:
        entry: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
        if req.return_documents:
            entry["document"] = {"text": docs[i]}
        results.append(entry)
    usage = handler.usage(outs)
    return {"id": handler.id, "model": lora or server.model_name,
            "usage": {"total_tokens": usage["total_tokens"]}, "results": results}
