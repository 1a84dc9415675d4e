"""The offline API: ``LLM(model=None, **config).generate(prompts, sampling_params)``."""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from tqdm.auto import tqdm

from kvray.config import (
    ConfigError,
    EngineConfig,
    config_from_flat,
    load_config,
    read_chat_template,
)
from kvray.engine.beam_search import (
    BeamSearch,
    BeamSearchOutput,
    BeamSearchParams,
    run_beam_searches,
    top_logprobs_of,
)
from kvray.engine.llm_engine import LLMEngine, PromptType
from kvray.inputs import detect_content_format, message_content, score_pairs
from kvray.lora.request import LoRARequest
from kvray.models.pooling import cosine_similarity
from kvray.outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    PoolingOutput,
    PoolingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from kvray.sampling_params import PoolingParams, RequestOutputKind, SamplingParams

Conversation = list[dict[str, Any]]

# vLLM engine arguments kvray has no key for, accepted where they ask for what kvray does
# anyway (a script written for vLLM keeps working); the rule a value must meet, and why
_VLLM_ARGS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "trust_remote_code": (lambda v: isinstance(v, bool),
                          "a bool (kvray runs its own model code)"),
    "tokenizer_mode": (lambda v: v in ("auto", "hf"), "'auto' or 'hf'"),
    "revision": (lambda v: v in (None, "main"), "None: kvray loads local files only"),
    "tokenizer_revision": (lambda v: v in (None, "main"), "None: kvray loads local files"),
    "code_revision": (lambda v: v in (None, "main"), "None: kvray loads local files only"),
    "download_dir": (lambda v: True, ""),  # kvray never downloads
    "load_format": (lambda v: v in ("auto", "safetensors", "pt", "gguf"),
                    "one of auto, safetensors, pt, gguf (read from the files themselves)"),
    "task": (lambda v: True, ""),  # kvray takes the task from the architecture
    "runner": (lambda v: True, ""),
    "disable_custom_all_reduce": (lambda v: isinstance(v, bool), "a bool"),
    "disable_async_output_proc": (lambda v: isinstance(v, bool), "a bool"),
    "max_seq_len_to_capture": (lambda v: isinstance(v, int), "an int"),
    "cpu_offload_gb": (lambda v: not v, "0 (kvray offloads no weights)"),
    "hf_overrides": (lambda v: not v, "empty (kvray takes the checkpoint's config)"),
    "enable_sleep_mode": (lambda v: v is False, "False (no sleep mode)"),
}


def _vllm_engine_args(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` without the vLLM-only arguments in :data:`_VLLM_ARGS` (a ConfigError
    naming one whose value asks for something kvray does not do); ``disable_log_stats``
    becomes ``log_stats``."""
    out = {}
    for key, value in kwargs.items():
        if key == "disable_log_stats":
            out.setdefault("log_stats", not value)
        elif key in _VLLM_ARGS:
            ok, rule = _VLLM_ARGS[key]
            if not ok(value):
                raise ConfigError(f"{key} = {value!r}: kvray accepts vLLM's {key} only as "
                                  f"{rule}")
        else:
            out[key] = value
    fmt, model = kwargs.get("load_format"), kwargs.get("model")  # (a YAML's model: unseen)
    is_gguf = str(model).endswith(".gguf")
    if isinstance(model, str) and fmt in ("safetensors", "pt", "gguf") \
            and (fmt == "gguf") != is_gguf:
        raise ConfigError(f"load_format = {fmt!r}, but the model ({model}) is "
                          f"{'a GGUF file' if is_gguf else 'not a GGUF file'}; use 'auto' "
                          "(kvray reads the format from the files)")
    return out


def _template_messages(conv: Conversation, content_format: str) -> Conversation:
    """A conversation as vLLM's ``LLM.chat`` hands it to the template: each content as
    ``content_format`` takes it (:func:`kvray.inputs.message_content`; parts must be
    text), earlier tool calls' JSON-text ``arguments`` as objects (templates render them
    as such; Llama 3.1's would encode the text again)."""
    out = []
    for i, m in enumerate(conv):
        if not isinstance(m, dict):
            out.append(m)
            continue
        m = {**m, "content": message_content(m.get("content"), content_format,
                                             f"messages.{i}.content")}
        if isinstance(m.get("tool_calls"), list):
            m["tool_calls"] = [_call_with_object_arguments(c) for c in m["tool_calls"]]
        out.append(m)
    return out


def _call_with_object_arguments(call: Any) -> Any:
    fn = call.get("function") if isinstance(call, dict) else None
    args = fn.get("arguments") if isinstance(fn, dict) else None
    if not isinstance(args, str):
        return call
    try:
        parsed = json.loads(args) if args.strip() else {}
    except ValueError:
        return call  # not JSON: the template gets the text as it is
    return {**call, "function": {**fn, "arguments": parsed}}


def _for_task(pooling: PoolingParams | None, task: str) -> PoolingParams:
    """``pooling`` for ``task`` (what ``embed``/``classify``/``encode(pooling_task=)``
    ask for, whatever task the params named): a token task's per-token pooling type
    goes, and comes with a token task."""
    pooling = pooling or PoolingParams()
    keep = None if pooling.pooling_type == "all" else pooling.pooling_type
    return dataclasses.replace(pooling, task=task, pooling_type=keep)


def _prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    """One prompt (text, token ids or a prompt dict) or several, as a list."""
    if isinstance(prompts, str | dict) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        return [prompts]
    return list(prompts)


class LLM:
    """Generate text for batches of prompts with the paged, continuously batched engine.

    Args:
        model: Hugging Face directory or .gguf file; None = the built-in SmolLM2-135M.
        config: a flat YAML config file; ``kwargs`` override it.
        **kwargs: any config key (``dtype``, ``block_size``, ``max_num_seqs`` ...), and
            vLLM's engine arguments that ask for what kvray does anyway
            (``trust_remote_code``, ``disable_log_stats``, ``load_format="auto"`` ...).
    """

    def __init__(self, model: str | os.PathLike | None = None,
                 config: str | os.PathLike | None = None, **kwargs: Any) -> None:
        if model is not None:
            kwargs["model"] = os.fspath(model) if isinstance(model, os.PathLike) else model
        # unset (None) keys keep the default, as flags parsed by EngineArgs.add_cli_args
        # and passed whole (vLLM's ``LLM(**vars(args))``)
        kwargs = {k: v for k, v in kwargs.items() if v is not None}
        kwargs = _vllm_engine_args(kwargs)
        engine_config: EngineConfig = (load_config(config, **kwargs) if config is not None
                                       else config_from_flat(kwargs))
        self.llm_engine = LLMEngine(engine_config)
        self._counter = itertools.count()
        # Release Ray workers and the placement group on shutdown() or when collected/exiting.
        self._finalizer = weakref.finalize(self, self.llm_engine.shutdown)

    def shutdown(self) -> None:
        """Stop the engine's workers; the cluster is left as it was found."""
        self._finalizer()

    def add_lora(self, lora_request: LoRARequest) -> None:
        """Register (and validate) an adapter ahead of the requests that use it."""
        self.llm_engine.add_lora(lora_request)

    def remove_lora(self, name: str) -> bool:
        """Stop serving adapter ``name``; False if it is unknown."""
        return self.llm_engine.remove_lora(name)

    def list_loras(self) -> list[str]:
        """The names of the adapters served (``llm_engine.list_loras()``: their ids)."""
        return self.llm_engine.lora_registry().names()

    def get_tokenizer(self):
        """The engine's tokenizer; ValueError with skip_tokenizer_init (vLLM's)."""
        return self.llm_engine.get_tokenizer()

    def reset_prefix_cache(self) -> bool:
        """Drop every cached prefix block (e.g. between benchmark rounds), as vLLM's
        ``LLM.reset_prefix_cache``; False, changing nothing, while requests run."""
        if self.llm_engine.has_unfinished_requests():
            return False
        return self.llm_engine.scheduler.kv.pool.reset_cache()

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate`` / ``chat`` use without ``sampling_params``: vLLM's defaults
        with the model's generation_config.json values over them (``generation_config``)."""
        return SamplingParams(**self.llm_engine.sampling_defaults)

    def expert_load(self) -> dict[int, list[int]]:
        """MoE models: tokens routed to each expert of each layer so far (global layer ->
        count per expert; empty for a dense model). See :meth:`LLMEngine.expert_load`."""
        return self.llm_engine.expert_load()

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: Sequence[int] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                 ) -> list[RequestOutput]:
        """Complete every prompt; outputs come back in input order.

        Prompts may be strings, ``{"prompt_token_ids": [...]}`` dicts, or a mix; one
        SamplingParams for all or one per prompt; ``lora_request`` one LoRA adapter for all
        prompts or one per prompt (None: the base model), as vLLM takes them.
        """
        prompts = _prompt_list(prompts)
        params = sampling_params if sampling_params is not None \
            else self.get_default_sampling_params()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling_params for {len(prompts)} prompts")
        # Only finished outputs are returned: the engine need not build the others.
        params = [dataclasses.replace(p, output_kind=RequestOutputKind.FINAL_ONLY)
                  for p in params]
        priority = list(priority) if priority is not None else [0] * len(prompts)
        loras = list(lora_request) if isinstance(lora_request, list | tuple) \
            else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"got {len(loras)} lora_requests for {len(prompts)} prompts")
        ids = []
        try:
            for prompt, p, prio, lora in zip(prompts, params, priority, loras, strict=True):
                request_id = str(next(self._counter))
                self.llm_engine.add_request(request_id, prompt, p, priority=prio,
                                            lora_request=lora)
                ids.append(request_id)
        except BaseException:
            for request_id in ids:  # none of this call's requests stays queued
                self.llm_engine.abort_request(request_id)
            raise
        return self._run(ids, use_tqdm)

    def beam_search(self, prompts: PromptType | Sequence[PromptType],
                    params: BeamSearchParams,
                    lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                    ) -> list[BeamSearchOutput]:
        """Beam-search every prompt (forms as :meth:`generate` takes them); one output per
        prompt, in input order, each with ``params.beam_width`` sequences best first;
        ``lora_request`` as :meth:`generate` takes it.

        Runs above the engine (:mod:`kvray.engine.beam_search`): each step is one
        ``generate`` call with a one-token request per live beam of every prompt (of one
        adapter), which the prefix cache serves from the blocks of the prompt and the
        beam's earlier tokens.
        """
        prompts = _prompt_list(prompts)
        loras = list(lora_request) if isinstance(lora_request, list | tuple) \
            else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"got {len(loras)} lora_requests for {len(prompts)} prompts")
        engine = self.llm_engine
        searches = []
        for prompt in prompts:
            text, ids = engine._tokenize(prompt)
            searches.append(BeamSearch(ids, params, engine.eos_token_ids, text,
                                       engine.max_model_len))
        by_adapter: dict[str | None, list[int]] = {}
        for i, lora in enumerate(loras):
            by_adapter.setdefault(None if lora is None else lora.lora_name, []).append(i)
        for members in by_adapter.values():
            lora = loras[members[0]]

            def run_step(batch: list[list[int]], step_params: list[SamplingParams],
                         lora: LoRARequest | None = lora):
                outs = self.generate([{"prompt_token_ids": p} for p in batch], step_params,
                                     use_tqdm=False, lora_request=lora)
                return [top_logprobs_of(out) for out in outs]

            run_beam_searches([searches[i] for i in members], run_step)
        return [search.output(self.llm_engine.tokenizer) for search in searches]

    def encode(self, prompts: PromptType | Sequence[PromptType],
               pooling_params: PoolingParams | None = None, use_tqdm: bool = True,
               truncate_prompt_tokens: int | None = None,
               lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
               pooling_task: str | None = None) -> list[PoolingRequestOutput]:
        """Each prompt's pooling result as a tensor (``outputs.data``), for ``pooling_task``
        (vLLM's; default: ``pooling_params``' task, ``embed``): an embedding, the class
        scores (``classify``), or one row per prompt token (``token_embed``,
        ``token_classify``)."""
        import torch

        pooling = pooling_params or PoolingParams()
        if pooling_task is not None:
            pooling = _for_task(pooling, pooling_task)
        return [PoolingRequestOutput(out.request_id, PoolingOutput(torch.tensor(out.pooled)),
                                     out.prompt_token_ids)
                for out in self._pool(prompts, pooling, use_tqdm, truncate_prompt_tokens,
                                      lora_request)]

    def embed(self, prompts: PromptType | Sequence[PromptType],
              pooling_params: PoolingParams | None = None, use_tqdm: bool = True,
              truncate_prompt_tokens: int | None = None,
              lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
              ) -> list[EmbeddingRequestOutput]:
        """Each prompt's embedding (``outputs.embedding``): the final hidden states pooled
        as the model says (its sentence-transformers config, else the last token,
        normalised) or as ``pooling_params`` asks."""
        outs = self._pool(prompts, _for_task(pooling_params, "embed"), use_tqdm,
                          truncate_prompt_tokens, lora_request)
        return [EmbeddingRequestOutput(out.request_id, EmbeddingOutput(out.pooled),
                                       out.prompt_token_ids) for out in outs]

    def classify(self, prompts: PromptType | Sequence[PromptType], use_tqdm: bool = True,
                 pooling_params: PoolingParams | None = None,
                 truncate_prompt_tokens: int | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                 ) -> list[ClassificationRequestOutput]:
        """Each prompt's class probabilities (``outputs.probs``) from a
        ``*ForSequenceClassification`` model: its activation (softmax; a sigmoid for one
        label) of the head's logits, which ``PoolingParams(activation=False)`` returns."""
        pooling = _for_task(pooling_params, "classify")
        return [ClassificationRequestOutput(out.request_id, ClassificationOutput(out.pooled),
                                            out.prompt_token_ids)
                for out in self._pool(prompts, pooling, use_tqdm, truncate_prompt_tokens,
                                      lora_request)]

    def reward(self, prompts: PromptType | Sequence[PromptType], use_tqdm: bool = True,
               pooling_params: PoolingParams | None = None,
               truncate_prompt_tokens: int | None = None,
               lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
               ) -> list[PoolingRequestOutput]:
        """A reward model's scores at every prompt token (vLLM's ``LLM.reward``): the
        classification head's activated logits, one row per token (``outputs.data``)."""
        return self.encode(prompts, pooling_params, use_tqdm, truncate_prompt_tokens,
                           lora_request, pooling_task="token_classify")

    def score(self, data_1: str | Sequence[str], data_2: str | Sequence[str],
              use_tqdm: bool = True, truncate_prompt_tokens: int | None = None,
              lora_request: LoRARequest | None = None) -> list[ScoringRequestOutput]:
        """How well each text of ``data_2`` goes with ``data_1`` (one text against each, or
        pairwise for lists of one length), as vLLM's ``LLM.score``: a cross-encoder's
        (reranker's) activated logit for the pair, or on an embedding model the cosine
        similarity of the two embeddings."""
        pairs = score_pairs(data_1, data_2, ("data_1", "data_2"))
        if not pairs:
            raise ValueError("score: data_2 holds no text")
        for text in itertools.chain.from_iterable(pairs):
            if not isinstance(text, str):
                raise ValueError(f"score: texts must be strings, got {type(text).__name__}")
        engine = self.llm_engine
        if engine.spec.head == "classify":
            if engine.spec.num_labels != 1:
                raise ValueError(f"score: this model has {engine.spec.num_labels} labels; "
                                 "a cross-encoder score needs one (a reranker)")
            tok = self.get_tokenizer()
            encoded = [{"prompt_token_ids": list(tok(a, text_pair=b)["input_ids"])}
                       for a, b in pairs]
            outs = self._pool(encoded, PoolingParams(task="classify"), use_tqdm,
                              truncate_prompt_tokens, lora_request)
            return [ScoringRequestOutput(out.request_id, ScoringOutput(out.pooled[0]),
                                         out.prompt_token_ids) for out in outs]
        texts = list(dict.fromkeys(itertools.chain.from_iterable(pairs)))
        embedded = self._pool(texts, PoolingParams(), use_tqdm, truncate_prompt_tokens,
                              lora_request)
        by_text = dict(zip(texts, embedded, strict=True))
        return [ScoringRequestOutput(
            f"{by_text[a].request_id}+{by_text[b].request_id}",
            ScoringOutput(cosine_similarity(by_text[a].pooled, by_text[b].pooled)),
            by_text[a].prompt_token_ids + by_text[b].prompt_token_ids)
            for a, b in pairs]

    def _pool(self, prompts: PromptType | Sequence[PromptType], pooling: PoolingParams,
              use_tqdm: bool, truncate_prompt_tokens: int | None = None,
              lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
              ) -> list[RequestOutput]:
        """Run pooling requests (``truncate_prompt_tokens``: each prompt's last k tokens)."""
        return self.generate(prompts, SamplingParams(
            pooling=pooling, truncate_prompt_tokens=truncate_prompt_tokens), use_tqdm,
            lora_request=lora_request)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm,
                   dynamic_ncols=True)
        in_toks = out_toks = 0
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        in_toks += len(out.prompt_token_ids)
                        out_toks += sum(len(c.token_ids) for c in out.outputs)
                        elapsed = bar.format_dict["elapsed"] or 1e-9
                        bar.set_postfix_str(f"input {in_toks / elapsed:.1f} tok/s, "
                                            f"output {out_toks / elapsed:.1f} tok/s")
                        bar.update(1)
        except BaseException:
            for request_id in ids:  # leave the engine clean for the next call
                engine.abort_request(request_id)
            raise
        finally:
            bar.close()
        return [done[i] for i in ids]

    def chat(self, messages: Conversation | Sequence[Conversation],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             tools: list[dict[str, Any]] | None = None,
             chat_template_kwargs: dict[str, Any] | None = None,
             chat_template: str | None = None,
             continue_final_message: bool = False,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
             chat_template_content_format: str = "auto",
             ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them via the chat template;
        ``tools`` (OpenAI's function specs) go to the template as vLLM's ``LLM.chat`` passes
        them. The reply is text: :func:`kvray.serve.tools.parse_tool_calls` finds calls in
        it, and ``structured_outputs={"json": required_schema(...)}`` forces them.
        ``chat_template_kwargs`` are further template variables (``enable_thinking``);
        ``chat_template`` (a file or the Jinja text) replaces the configured template for
        this call, as in vLLM. ``continue_final_message`` leaves each conversation's last
        (assistant) message open for the reply to continue it (with
        ``add_generation_prompt=False``). A message's content may be OpenAI's list of
        text parts, joined into one string for the template (``chat_template_content_format``
        ``auto`` / ``string``) or handed to it as parts (``openai``); ``lora_request`` as in
        :meth:`generate`."""
        if chat_template_content_format not in ("auto", "string", "openai"):
            raise ValueError(f"chat_template_content_format = {chat_template_content_format!r}"
                             ": must be auto, string or openai")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message cannot be combined with "
                             "add_generation_prompt; set add_generation_prompt=False")
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tok = self.get_tokenizer()
        template = read_chat_template(chat_template) if chat_template is not None else None
        if not (template or getattr(tok, "chat_template", None)):
            raise ValueError("this model's tokenizer has no chat template; give chat_template "
                             "or use generate()")
        prompts = []
        fmt = chat_template_content_format
        if fmt == "auto":  # vLLM's: parts for a template that loops over them
            fmt = detect_content_format(template or tok.chat_template)
        for conv in convs:
            conv = _template_messages(conv, fmt)
            extra = dict(chat_template_kwargs or {})
            extra["continue_final_message"] = continue_final_message
            if template is not None:
                extra["chat_template"] = template
            ids = tok.apply_chat_template(conv, tools=tools,
                                          add_generation_prompt=add_generation_prompt,
                                          tokenize=True, return_dict=True, **extra)["input_ids"]
            text = tok.apply_chat_template(conv, tools=tools,
                                           add_generation_prompt=add_generation_prompt,
                                           tokenize=False, **extra)
            prompts.append({"prompt_token_ids": list(ids), "prompt": text})
        return self.generate(prompts, sampling_params, use_tqdm, lora_request=lora_request)
