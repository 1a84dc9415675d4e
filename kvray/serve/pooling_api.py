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

from kvray.inputs import score_pairs
from kvray.models.pooling import cosine_similarity
from kvray.outputs import RequestOutput
from kvray.sampling_params import PoolingParams, RequestOutputKind, SamplingParams
from kvray.serve.completions import ServerContext
from kvray.serve.http import APIError, api_error_from
from kvray.serve.protocol import PRIORITY_MAX, PRIORITY_MIN, _Request, new_id, now

Prompt = str | list[int]


class EmbeddingRequest(_Request):
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None
    normalize: bool | None = None  # vLLM extra: None = the model's choice
    priority: int = Field(0, ge=PRIORITY_MIN, le=PRIORITY_MAX)


class ClassificationRequest(_Request):
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    user: str | None = None
    activation: bool = True  # vLLM extra: False returns the raw logits as "probs"
    priority: int = Field(0, ge=PRIORITY_MIN, le=PRIORITY_MAX)


class ScoreRequest(_Request):
    model: str | None = None
    # vLLM's names over its versions: text_1 / text_2, data_1 / data_2, queries / documents
    text_1: str | list[str] = Field(validation_alias=AliasChoices("text_1", "data_1",
                                                                  "queries"))
    text_2: str | list[str] = Field(validation_alias=AliasChoices("text_2", "data_2",
                                                                  "documents"))
    priority: int = Field(0, ge=PRIORITY_MIN, le=PRIORITY_MAX)


class RerankRequest(_Request):
    model: str | None = None
    query: str
    documents: list[str | dict[str, Any]] = Field(min_length=1)
    top_n: int | None = Field(None, ge=1)
    return_documents: bool = True
    priority: int = Field(0, ge=PRIORITY_MIN, le=PRIORITY_MAX)


class PoolingHandler:
    """Runs a request's prompts as pooling requests, all at once, and gathers their
    vectors (a refused or invalid prompt is the whole request's 4xx, naming ``field``)."""

    def __init__(self, server: ServerContext, lora: str | None, priority: int) -> None:
        self.server, self.lora, self.priority = server, lora, priority
        self.id = new_id("embd")

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

    async def pool(self, prompts: list[Prompt | tuple[str, str]], pooling: PoolingParams,
                   field: str) -> list[RequestOutput]:
        """Each prompt's final output (``pooled`` set); a text pair is encoded as the
        tokenizer pairs texts."""
        ids = await self.server.off_loop(self._token_ids, prompts)
        params = SamplingParams(max_tokens=1, pooling=pooling,
                                output_kind=RequestOutputKind.FINAL_ONLY)
        for prompt_ids in ids:
            if len(prompt_ids) + 1 > self.server.max_model_len:
                raise APIError(400, f"{field}: an input of {len(prompt_ids)} tokens exceeds "
                               f"the model's context length ({self.server.max_model_len})",
                               "BadRequestError", field)
        return await asyncio.gather(*(self._one(f"{self.id}-{i}", prompt_ids, params, field)
                                      for i, prompt_ids in enumerate(ids)))

    def _token_ids(self, prompts: list[Prompt | tuple[str, str]]) -> list[list[int]]:
        tok = self.server.tokenizer
        out = []
        for p in prompts:
            if isinstance(p, tuple):
                out.append(list(tok(p[0], text_pair=p[1])["input_ids"]))
            elif isinstance(p, str):
                out.append(list(tok(p)["input_ids"]))
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
            async for out in self.server.stream(request_id, prompt, params, self.priority):
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
    handler = PoolingHandler(server, lora, req.priority)
    prompts = _inputs(req.input)
    handler.check_prompts(prompts, "input")
    outs = await handler.pool(prompts, PoolingParams(dimensions=req.dimensions,
                                                     normalize=req.normalize), "input")
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
    handler = PoolingHandler(server, lora, req.priority)
    prompts = _inputs(req.input)
    handler.check_prompts(prompts, "input")
    outs = await handler.pool(prompts, PoolingParams(task="classify",
                                                     activation=req.activation), "input")
    labels = getattr(server, "model_labels", ())
    data = []
    for i, out in enumerate(outs):
        best = max(range(len(out.pooled)), key=out.pooled.__getitem__)
        data.append({"index": i, "label": labels[best] if best < len(labels)
                     else f"LABEL_{best}", "probs": out.pooled,
                     "num_classes": len(out.pooled)})
    usage = handler.usage(outs)
    return {"id": new_id("classify"), "object": "list", "created": now(),
            "model": lora or server.model_name, "data": data,
            "usage": {**usage, "completion_tokens": 0}}


def _inputs(value: Any) -> list[Prompt]:
    if isinstance(value, str):
        return [value]
    if value and all(isinstance(x, int) for x in value):
        return [list(value)]
    return list(value)


def _encode(vector: list[float], encoding: str) -> list[float] | str:
    if encoding == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()


async def _scores(server: ServerContext, handler: PoolingHandler, pairs: list[tuple[str, str]],
                  classify: bool) -> tuple[list[float], list[RequestOutput]]:
    """One score per (a, b) pair: the classification head's activated logit, or the
    cosine similarity of the two texts' embeddings."""
    if classify:
        outs = await handler.pool(pairs, PoolingParams(task="classify"), "text_1")
        for out in outs:
            if len(out.pooled) != 1:
                raise APIError(400, f"this model has {len(out.pooled)} labels; scores need a "
                               "model with one (a reranker)", "BadRequestError", "model")
        return [out.pooled[0] for out in outs], outs
    texts = sorted({t for pair in pairs for t in pair})
    outs = await handler.pool(texts, PoolingParams(normalize=False), "text_1")
    vectors = dict(zip(texts, (o.pooled for o in outs), strict=True))
    return [cosine_similarity(vectors[a], vectors[b]) for a, b in pairs], outs


async def create_scores(server: ServerContext, req: ScoreRequest, lora: str | None,
                        classify: bool) -> dict[str, Any]:
    try:
        pairs = score_pairs(req.text_1, req.text_2, ("text_1", "text_2"))
    except ValueError as err:
        raise APIError(400, str(err), "BadRequestError", "text_2") from None
    first, second = [a for a, _ in pairs], [b for _, b in pairs]
    handler = PoolingHandler(server, lora, req.priority)
    handler.check_prompts(first, "text_1")
    handler.check_prompts(second, "text_2")
    scores, outs = await _scores(server, handler, pairs, classify)
    return {"id": new_id("score"), "object": "list", "created": now(),
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
    handler = PoolingHandler(server, lora, req.priority)
    handler.check_prompts([req.query], "query")
    handler.check_prompts(docs, "documents")
    scores, outs = await _scores(server, handler, [(req.query, d) for d in docs], classify)
    order = sorted(range(len(docs)), key=lambda i: -scores[i])[:req.top_n or len(docs)]
    results = []
    for i in order:
        entry: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
        if req.return_documents:
            entry["document"] = {"text": docs[i]}
        results.append(entry)
    usage = handler.usage(outs)
    return {"id": new_id("rerank"), "model": lora or server.model_name,
            "usage": {"total_tokens": usage["total_tokens"]}, "results": results}
