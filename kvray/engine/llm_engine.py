"""LLMEngine: requests in, one scheduling + execution step at a time, outputs out.

``add_request`` tokenizes and queues; ``step`` schedules, runs the executor, applies the
sampled tokens, detokenizes, checks stop strings and returns the outputs that changed.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from kvray.actors.executor import Executor, initialize_kv_cache, make_executor
from kvray.actors.weights_store import local_model_path
from kvray.config import EngineConfig
from kvray.engine.detokenizer import IncrementalDetokenizer
from kvray.engine.generation_config import (
    generation_defaults,
    generation_eos_ids,
    generation_max_tokens_cap,
)
from kvray.engine.request_state import RequestState, SequenceState
from kvray.engine.stats import EngineStats
from kvray.errors import EngineUnavailableError, InvalidRequestError
from kvray.inputs import truncate_prompt
from kvray.lora.manager import LoRARegistry
from kvray.lora.request import LoRARequest
from kvray.models.default_model import resolve_model_path, with_builtin_model
from kvray.models.expert_placement import placement_summary
from kvray.models.pooling import activated, model_pooling
from kvray.outputs import Logprob, RequestOutput
from kvray.sampling_params import SamplingParams
from kvray.scheduler.kv_tier import KVTier, LocalKVTier
from kvray.scheduler.output import ModelRunnerOutput, SchedulerOutput
from kvray.scheduler.preemption import measure_costs
from kvray.scheduler.request import Request, RequestStatus
from kvray.scheduler.scheduler import Scheduler
from kvray.scheduler.swap import swap_pool_blocks
from kvray.structured_output import GrammarCompiler, compiler_for
from kvray.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)
PromptType = str | list[int] | dict[str, Any]
# Longest wait between reads of the workers' expert token counts while steps run: a read is
# a round trip to every pipeline stage, too dear for every step.
EXPERT_TOKENS_PERIOD_S = 10.0


class EngineDeadError(EngineUnavailableError, RuntimeError):
    """The executor failed (e.g. a worker died); in-flight requests were aborted. The next
    request rebuilds the executor."""


class LLMEngine:
    """The engine core of one model replica: scheduler + executor (in-process or Ray)."""

    @classmethod
    def from_engine_args(cls, engine_args: Any) -> LLMEngine:
        """vLLM's constructor: the engine of an :class:`kvray.utils.EngineArgs`."""
        return cls(engine_args.create_engine_config())

    def __init__(self, config: EngineConfig,
                 lora_source: Callable[[str], Any] | None = None,
                 kv_tier: KVTier | None = None) -> None:
        """``lora_source``: where adapters not registered here come from (a Serve
        application's shared directory; then ``lora_modules`` are read there, not here).
        ``kv_tier``: where evicted prefix blocks go (a Serve application's shared tier);
        by default, with ``kv_offload_bytes``, this engine's own in its process."""
        config = with_builtin_model(config)
        self._lora_source = lora_source
        if kv_tier is None and config.cache.kv_offload_bytes:
            kv_tier = LocalKVTier(config.cache.kv_offload_bytes)
        self.kv_tier = kv_tier
        self.config = config
        self.model_path = str(resolve_model_path(config.model.model))
        # the workers take the model's files from the object store themselves if need be
        local_path = local_model_path(self.model_path, config.model.share_weights)
        # None with skip_tokenizer_init: token ids in and out, no text
        self.tokenizer = None if config.model.skip_tokenizer_init else load_tokenizer(
            local_path, config.model.tokenizer, config.model.chat_template)
        self._token_texts: dict[int, str] = {}  # token id -> its text alone (logprobs)
        # what a request's unset sampling parameters default to (the model's own)
        self.sampling_defaults = generation_defaults(
            config.model.generation_config, local_path, config.model.override_generation_config)
        # served requests generate at most this many tokens, whatever they ask (vLLM's)
        self.max_tokens_cap = generation_max_tokens_cap(
            config.model.generation_config, config.model.override_generation_config,
            self.sampling_defaults)
        self.stats = EngineStats()
        # A copy taken by the engine's own thread after each update, for readers on other
        # threads: they never see a half-updated set of gauges (running but no blocks).
        self.published_stats = EngineStats()
        self._parents: dict[str, RequestState] = {}
        self._failed: list[tuple[str, str]] = []  # see pop_failed_requests
        self._child_to_parent: dict[str, tuple[str, int]] = {}
        # Each request's sequences run under ids of their own ("<id>@<serial>", "#<i>" for
        # n > 1): a step scheduled ahead (async scheduling, pipeline micro-batches) may still
        # report on a finished or aborted request when a new one reuses its id; such a
        # result names no live sequence and is dropped, never given to the newcomer.
        self._serial = itertools.count()
        self.executor: Executor | None = None
        self.loras: LoRARegistry | None = None  # the adapters served (LoRA on)
        # Steps submitted and not yet collected, oldest first: (output, handle, start time).
        self._in_flight: deque[tuple[SchedulerOutput, Any, float]] = deque()
        self._last_collect = 0.0  # when the previous step's result came back
        self._expert_tokens_read = 0.0  # when the expert token counts were last read
        self._build_executor()
        # The tokenizer's EOS ends a sequence as EOS (stop_reason None); the other ids
        # config.json and generation_config.json name end it as stop tokens do (their id
        # is the stop_reason), as vLLM adds them to each request's stop ids.
        tok_eos = None if self.tokenizer is None else self.tokenizer.eos_token_id
        primary = {tok_eos} if tok_eos is not None else set(self.spec.eos_token_ids)
        named = set(self.spec.eos_token_ids) | set(generation_eos_ids(
            config.model.generation_config, local_path))
        self._request_eos = tuple(sorted(primary))
        self._eos_stops = tuple(sorted(i for i in named - primary if i < self.spec.vocab_size))
        # every id that ends a sequence (beam search, grammars' end)
        self.eos_token_ids = tuple(sorted(primary | set(self._eos_stops)))
        self.pooling = model_pooling(local_path, classify=self.spec.head == "classify")

    def _startup_report(self, workers_s: float, kv_s: float, total_s: float) -> dict:
        """Where the engine's start-up went, logged once: workers (their processes, the
        weights and the kernels), the KV cache, the rest (cost probes); per rank the load
        and how it got its CPU kernels (compiled, this machine's cache, the cluster's)."""
        ranks = self.executor.collective_rpc("startup_report")
        report = {"total_s": round(total_s, 3), "workers_s": round(workers_s, 3),
                  "kv_cache_s": round(kv_s, 3), "ranks": ranks}
        slowest = max(ranks, key=lambda r: r["load_s"])
        logger.info("kvray: start-up %.1f s: workers and weights %.1f s (slowest rank's "
                    "load %.1f s, CPU kernels %s in %.1f s), KV cache %.1f s, other %.1f s",
                    total_s, workers_s, slowest["load_s"], slowest["kernels"]["source"],
                    slowest["kernels"]["seconds"], kv_s, total_s - workers_s - kv_s)
        experts = placement_summary([r.get("moe") for r in ranks])
        if experts is not None:
            logger.info("kvray: MoE: %s", experts)
        return report

    def rebuild_executor(self) -> None:
        """Build the executor again after a failure (no-op if it is up)."""
        if self.executor is None:
            self._build_executor()

    def _build_executor(self) -> None:
        """(Re)build the executor, the KV cache and an empty scheduler."""
        config = self.config
        start = time.perf_counter()
        self.executor = make_executor(config, self.model_path)
        workers_s = time.perf_counter() - start
        self.spec = self.executor.spec
        self.max_model_len = self.executor.max_model_len
        if config.lora.enabled and self.loras is None:  # kept across executor rebuilds
            self.loras = self._lora_registry()
        kv = initialize_kv_cache(self.executor)
        kv_s = time.perf_counter() - start - workers_s
        swap_blocks = swap_pool_blocks(config, kv.bytes_per_block)
        costs = None
        if config.scheduler.preemption_mode == "auto":
            costs = measure_costs(
                self.executor.execute_model,
                min(kv.num_blocks * config.cache.block_size, self.max_model_len,
                    config.scheduler.max_num_batched_tokens),
                config.cache.block_size, self.spec.vocab_size, kv.bytes_per_block, swap_blocks)
        if self.spec.num_experts:
            self._start_expert_tokens()
        self.startup = self._startup_report(workers_s, kv_s, time.perf_counter() - start)
        self.scheduler = Scheduler(config, kv.num_blocks, self.max_model_len, swap_blocks,
                                   costs, self.loras, self.kv_tier)
        self._in_flight.clear()
        self.stats.num_blocks = kv.num_blocks
        if costs is not None:
            self.stats.prefill_s_per_token = costs.prefill_s_per_token
            self.stats.swap_s_per_byte = costs.swap_s_per_byte
        self.published_stats = dataclasses.replace(self.stats)

    def _lora_registry(self) -> LoRARegistry:
        """The adapter registry, with ``lora_modules`` registered (an adapter that cannot
        be served stops the start, naming it). Under Ray each adapter's weights go to the
        object store once; every worker reads that copy."""
        put = None
        if type(self.executor).__name__ == "RayExecutor":
            import ray
            put = ray.put
        registry = LoRARegistry(self.config.lora, self.spec, put, self._lora_source)
        if self._lora_source is None:
            for name, path in self.config.lora.lora_modules.items():
                registry.register(name, path)
        return registry

    def shutdown(self) -> None:
        """Release the executor's workers (Ray actors and placement group)."""
        if self.executor is not None:
            self.executor.shutdown()
            self.executor = None

    # ---- requests -----------------------------------------------------------------------
    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("You cannot pass text prompts when "
                                          "skip_tokenizer_init=True: give prompt_token_ids",
                                          "prompt")
            return prompt, self.tokenizer(prompt)["input_ids"]
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return self._tokenize(prompt["prompt"])
            raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, list | tuple) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise ValueError(f"unsupported prompt type {type(prompt).__name__}: give a string, a "
                         "list of token ids or {'prompt_token_ids': [...]}")

    @staticmethod
    def _without_text(params: SamplingParams) -> SamplingParams:
        """``params`` for an engine with no tokenizer (skip_tokenizer_init): what needs text
        is refused naming the parameter; the output is token ids (empty text)."""
        for name, value in (("stop", params.stop), ("bad_words", params.bad_words),
                            ("structured_outputs", params.structured_outputs)):
            if value:
                raise InvalidRequestError(f"{name} needs the tokenizer, which "
                                          "skip_tokenizer_init=True leaves out", name)
        return dataclasses.replace(params, detokenize=False)

    def _bad_words_ids(self, params: SamplingParams) -> tuple[tuple[int, ...], ...]:
        """Each bad word as token ids, as vLLM reads them: the word alone, and after a
        space where that spells it with other tokens of the same count."""
        found: list[tuple[int, ...]] = []
        for word in params.bad_words or ():
            alone = tuple(self.tokenizer.encode(word.lstrip(), add_special_tokens=False))
            spaced = tuple(self.tokenizer.encode(" " + word.lstrip(),
                                                 add_special_tokens=False))
            for ids in (alone, spaced):
                if ids and ids not in found and (ids is alone or (
                        len(ids) == len(alone) and ids[0] != alone[0])):
                    found.append(ids)
        self._check_token_ids([t for ids in found for t in ids], "bad_words", "bad_words")
        return tuple(found)

    def _check_token_ids(self, ids: list[int], what: str, param: str) -> None:
        vocab = self.spec.vocab_size
        bad = [t for t in ids if not (isinstance(t, int) and 0 <= t < vocab)]
        if bad:
            raise InvalidRequestError(f"{what} holds token ids outside the vocabulary "
                                      f"[0, {vocab}): {bad[:5]}", param)

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                    arrival_time: float | None = None, priority: int = 0,
                    lora_request: LoRARequest | str | None = None) -> None:
        """Queue a request; raise ValueError (the request is not queued) if it is invalid
        or can never fit. ``lora_request``: the LoRA adapter to run with, by
        :class:`LoRARequest` (registered on first sight) or by a registered name
        (NotFoundError if unknown)."""
        if request_id in self._parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        if priority != 0 and self.config.scheduler.scheduling_policy != "priority":
            # vLLM refuses it too: under fcfs a priority would be silently ignored
            raise InvalidRequestError(
                f"Got priority {priority} but priority scheduling is not enabled "
                "(scheduler.scheduling_policy is 'fcfs'; set it to 'priority')", "priority")
        if self.executor is None:
            self._build_executor()
        if isinstance(prompt, dict) and prompt.get("lora_name") and lora_request is None:
            lora_request = prompt["lora_name"]  # the HTTP front end names the adapter here
        text, ids = self._tokenize(prompt)
        if params.truncate_prompt_tokens is not None:
            kept = truncate_prompt(ids, params.truncate_prompt_tokens, self.max_model_len,
                                   generates=params.pooling is None)
            if kept is not ids:
                text, ids = None, kept
        self._check_token_ids(ids, "the prompt", "prompt")
        self._check_token_ids(list(params.logit_bias or {}), "logit_bias", "logit_bias")
        self._check_token_ids(params.stop_token_ids, "stop_token_ids", "stop_token_ids")
        self._check_token_ids(params.allowed_token_ids or [], "allowed_token_ids",
                              "allowed_token_ids")
        if self.tokenizer is None:
            params = self._without_text(params)
        params = dataclasses.replace(params, **self._end_ids(params),
                                     bad_words_token_ids=self._bad_words_ids(params))
        if params.pooling is not None:
            params = self._pooling_params(params)
        elif self.spec.is_pooling_model:
            raise InvalidRequestError(
                f"this model ({self.spec.architecture}) is a pooling model: it serves "
                "embeddings and scores, not generated text", "model")
        if params.structured_outputs is not None:  # an invalid grammar is the client's 400
            self._grammar_compiler().compile(params.structured_outputs)
        adapter = self._adapter(lora_request)
        # A prompt that fits generates at most to the context's end (finish "length"), as
        # vLLM's engine caps it; the HTTP front end refuses such a request first (a 400).
        room = self.max_model_len - len(ids)
        max_tokens = min(params.max_tokens or room, room) if room >= 1 else \
            params.max_tokens or 1
        arrival = time.monotonic() if arrival_time is None else arrival_time
        parent = RequestState(request_id, text, ids, params,
                              prompt_logprobs=[] if params.prompt_logprobs is not None
                              else None,
                              lora_request=lora_request if isinstance(lora_request, LoRARequest)
                              else adapter)
        children = []
        serial = next(self._serial)
        for i in range(params.n):
            child_id = f"{request_id}@{serial}" + (f"#{i}" if params.n > 1 else "")
            seed = None if params.seed is None else (params.seed + i) % 2**64
            children.append(Request(child_id, ids, params, arrival, priority, max_tokens, seed,
                                    adapter.lora_int_id if adapter is not None else 0))
        for child in children:  # validate all before queueing any
            self.scheduler.check_request(child)
        for i, child in enumerate(children):
            self.scheduler.add_request(child)
            detok = IncrementalDetokenizer(self.tokenizer, ids, params.stop,
                                           params.skip_special_tokens,
                                           params.include_stop_str_in_output,
                                           params.min_tokens)
            parent.seqs.append(SequenceState(child, detok, [] if params.logprobs is not None
                                             else None))
            self._child_to_parent[child.request_id] = (request_id, i)
        self._parents[request_id] = parent
        self._update_gauges()

    def _pooling_params(self, params: SamplingParams) -> SamplingParams:
        """A pooling request as the engine runs it: the model's pooling where the request
        leaves it open, prefill plus one greedy token (dropped); InvalidRequestError naming
        the field it cannot serve."""
        pooling = params.pooling
        classify = pooling.task in ("classify", "token_classify")
        if classify and self.spec.head != "classify":
            raise InvalidRequestError(
                f"this model ({self.spec.architecture}) has no classification head; "
                "scores need a *ForSequenceClassification model", "model")
        size = self.spec.num_labels if classify else self.spec.hidden_size
        if pooling.dimensions is not None and pooling.dimensions > size:
            raise InvalidRequestError(f"dimensions = {pooling.dimensions}: this model's "
                                      f"vectors have {size}", "dimensions")
        pooling = dataclasses.replace(
            pooling, pooling_type=pooling.pooling_type or self.pooling.pooling_type,
            normalize=self.pooling.normalize if pooling.normalize is None
            else pooling.normalize)
        return dataclasses.replace(
            params, pooling=pooling, n=1, max_tokens=1, min_tokens=0, temperature=0.0,
            logprobs=None, prompt_logprobs=None, structured_outputs=None, stop=[],
            stop_token_ids=[], logit_bias=None)

    # ---- adapters, as vLLM's LLMEngine manages them --------------------------------------
    def lora_registry(self) -> LoRARegistry:
        """The adapters served; ValueError when LoRA is off."""
        if self.loras is None:
            raise ValueError("LoRA is off: create the engine with enable_lora=True")
        return self.loras

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Register (and check) an adapter ahead of the requests that use it (LoRAError,
        naming why, if it cannot be served)."""
        self.lora_registry().resolve(lora_request)
        return True

    def remove_lora(self, lora: int | str) -> bool:
        """Stop serving an adapter, named or by the id :meth:`list_loras` gives; False if
        unknown."""
        registry = self.lora_registry()
        if isinstance(lora, int):
            lora = next((name for name, i in registry.client_ids().items() if i == lora), "")
        return registry.unregister(lora)

    def list_loras(self) -> set[int]:
        """The served adapters' ids (vLLM's): each its ``lora_int_id`` as registered."""
        return set(self.lora_registry().client_ids().values())

    def get_tokenizer(self):
        """The tokenizer requests' text goes through (vLLM's accessor); ValueError with
        skip_tokenizer_init, as vLLM's."""
        if self.tokenizer is None:
            raise ValueError("no tokenizer: the engine runs with skip_tokenizer_init=True")
        return self.tokenizer

    def _adapter(self, lora_request: LoRARequest | str | None) -> LoRARequest | None:
        """The registered adapter a request names (None: the base model; its id is the
        registry's), its weights in host memory (read again now if they were dropped: a
        read error is this request's)."""
        if lora_request is None:
            return None
        if self.loras is None:
            raise InvalidRequestError("this server runs no LoRA adapters (start it with "
                                      "enable_lora or lora_modules)", "model")
        resolved = self.loras.resolve(lora_request)
        self.loras.payload(resolved.lora_int_id)
        return resolved

    def _end_ids(self, params: SamplingParams) -> dict[str, Any]:
        """A request's EOS and stop ids: the model's other end ids join its stop ids (so
        ``stop_reason`` names them), or under ``ignore_eos`` its EOS ids (so
        ``min_tokens`` still bans them, as vLLM's ``_all_stop_token_ids``)."""
        if params.ignore_eos:
            return {"eos_token_ids": self._request_eos + self._eos_stops}
        extra = [t for t in self._eos_stops if t not in params.stop_token_ids]
        return {"eos_token_ids": self._request_eos,
                "stop_token_ids": list(params.stop_token_ids) + extra}

    def _grammar_compiler(self) -> GrammarCompiler:
        """Compiles constraints at admission to reject invalid ones (workers in other
        processes compile their own copies); built on first use: ~1 s to index the
        vocabulary."""
        return compiler_for(self.model_path, self.config.model.tokenizer,
                            self.spec.vocab_size, self.eos_token_ids, self.tokenizer)

    def abort_request(self, request_id: str) -> bool:
        """Abort a request (all its n sequences); False if it is unknown or done."""
        parent = self._parents.pop(request_id, None)
        if parent is None:
            return False
        for seq in parent.seqs:
            self.scheduler.abort_request(seq.request.request_id)
            self._child_to_parent.pop(seq.request.request_id, None)
        self._update_gauges()  # no step may follow: keep running/usage truthful now
        return True

    def refresh_swap_objects(self) -> None:
        """Count the swap objects the workers hold (one call to each) into the stats."""
        if self.executor is not None:
            self.stats.num_swap_objects = sum(self.executor.swap_objects())
            self.published_stats = dataclasses.replace(self.stats)

    def _start_expert_tokens(self) -> None:
        """Drop what the workers counted during start-up (the probes' made-up tokens are no
        expert's load) and list every MoE layer, at zero the first time: the series then
        start at 0 and a rate() over them sees the first tokens."""
        totals = dict(self.stats.moe_expert_tokens)  # kept across executor rebuilds
        for stage in self.executor.take_expert_tokens():
            for layer, counts in stage.items():
                totals.setdefault(layer, [0] * len(counts))
        self.stats.moe_expert_tokens = dict(sorted(totals.items()))
        self._expert_tokens_read = time.monotonic()

    def refresh_expert_tokens(self) -> None:
        """Add the tokens the workers routed to each expert since the previous read (one
        call per pipeline stage) to the stats; nothing to do for a dense model."""
        if self.executor is None or not self.spec.num_experts:
            return
        self._expert_tokens_read = time.monotonic()
        totals = dict(self.stats.moe_expert_tokens)
        for stage in self.executor.take_expert_tokens():
            for layer, counts in stage.items():
                have = totals.get(layer, [0] * len(counts))
                totals[layer] = [a + b for a, b in zip(have, counts, strict=True)]
        # a new dict, never changed in place: published copies share it
        self.stats.moe_expert_tokens = dict(sorted(totals.items()))
        self.published_stats = dataclasses.replace(self.stats)

    def expert_load(self) -> dict[int, list[int]]:
        """Tokens routed to each expert of each MoE layer since the engine started, as of
        now: global layer index -> count per expert (empty for a dense model). Written as
        JSON, what ``expert_placement`` reads to balance experts over the ranks."""
        self.refresh_expert_tokens()
        return {layer: list(counts) for layer, counts in self.stats.moe_expert_tokens.items()}

    def has_unfinished_requests(self) -> bool:
        return bool(self._parents)

    def get_num_unfinished_requests(self) -> int:
        return len(self._parents)

    # ---- one step -----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule and run one step; return outputs of requests that changed.

        With pipeline parallelism up to ``num_micro_batches`` steps are in flight, and one
        more with async scheduling: this submits steps until that many are in flight (or
        nothing more can run), then waits for the oldest and applies it."""
        if self.executor is None:
            raise EngineDeadError("the engine has been shut down")
        try:
            if time.monotonic() - self._expert_tokens_read >= EXPERT_TOKENS_PERIOD_S:
                self.refresh_expert_tokens()
            out, result, start = self._advance_pipeline()
        except Exception as err:
            self._fail_all(err)
            raise EngineDeadError(f"engine step failed, in-flight requests aborted: {err}"
                                  ) from err
        now = time.perf_counter()
        # Overlapping steps: count only the time this one added after the previous result.
        elapsed = now - max(start, self._last_collect)
        self._last_collect = now
        self._record_step(out, elapsed)
        updated = self.scheduler.update_from_output(out, result)
        touched = self._apply_prompt_logprobs(result)
        touched |= self._apply_pooled(result)
        touched |= self._apply_tokens(updated, result)
        self._update_gauges()
        return self._outputs_of(touched)

    def _advance_pipeline(self) -> tuple[SchedulerOutput, ModelRunnerOutput, float]:
        """Submit steps until ``num_micro_batches`` (+ 1 under async scheduling) are in
        flight (or nothing more can run), then wait for the oldest: its SchedulerOutput,
        its result and when it was submitted."""
        depth = self.scheduler.num_micro_batches + self.scheduler.async_scheduling
        while len(self._in_flight) < depth and (
                not self._in_flight or self.scheduler.has_schedulable_requests()):
            out = self.scheduler.schedule()
            if out.is_noop and self._in_flight:
                break  # nothing fits beside the steps in flight: wait for one
            self.stats.num_overlapped_steps += bool(self._in_flight)
            start = time.perf_counter()  # before submitting: in-process, it runs the step
            self._in_flight.append((out, self.executor.submit_step(out), start))
            if out.is_empty:
                break
        out, handle, start = self._in_flight.popleft()
        return out, self.executor.collect_step(handle), start

    def _outputs_of(self, touched: set[str]) -> list[RequestOutput]:
        """The outputs of the requests this step changed; finished ones are dropped."""
        outputs = []
        for parent_id in touched:
            parent = self._parents.get(parent_id)
            if parent is None:  # failed on its own (see _fail_request)
                continue
            try:
                out = parent.output()
            except Exception as err:
                self._fail_request(parent_id, err)
                continue
            if out is not None:
                outputs.append(out)
            if parent.finished:
                self._drop(parent_id)
        return outputs

    def _fail_all(self, err: Exception) -> None:
        """Abort every request and drop the executor; the next request rebuilds it."""
        self._in_flight.clear()
        for request_id in list(self._parents):
            self.abort_request(request_id)
        try:
            self.executor.shutdown()
        finally:
            self.executor = None

    def _record_step(self, out: SchedulerOutput, elapsed: float) -> None:
        s = self.stats
        s.num_steps += 1
        if out.is_empty:
            return
        s.step_time_s += elapsed
        # requests that finished or were aborted while the step ran are gone: not counted
        reqs = self.scheduler.requests
        live = [(reqs[r], n) for r, n in out.num_scheduled_tokens.items() if r in reqs]
        pure_decode = all(n == 1 and req.num_computed_tokens >= req.num_prompt_tokens
                          for req, n in live)
        s.prompt_tokens_total += sum(
            max(0, min(req.num_prompt_tokens - req.num_computed_tokens, n)) for req, n in live)
        if pure_decode:
            s.num_decode_steps += 1
            s.decode_time_s += elapsed
            s.decode_tokens += len(live)
            s.decode_context_tokens += sum(req.num_computed_tokens + 1 for req, _ in live)

    def _apply_pooled(self, result: ModelRunnerOutput) -> set[str]:
        """Keep each pooling request's vector for its final output."""
        touched = set()
        for req_id, vector in result.pooled.items():
            parent_id, _ = self._child_to_parent.get(req_id, (None, 0))
            parent = self._parents.get(parent_id)
            if parent is not None:
                pooling = parent.params.pooling
                if pooling is not None and pooling.activation:
                    if pooling.task == "classify":
                        vector = activated(vector, self.pooling.activation)
                    elif pooling.task == "token_classify":
                        vector = [activated(row, self.pooling.activation) for row in vector]
                parent.pooled = vector
                touched.add(parent_id)
        return touched

    def _apply_prompt_logprobs(self, result: ModelRunnerOutput) -> set[str]:
        touched = set()
        for req_id, (first, entries) in result.prompt_logprobs.items():
            parent_id, index = self._child_to_parent.get(req_id, (None, 0))
            parent = self._parents.get(parent_id)
            if parent is None or index != 0 or parent.prompt_logprobs is None:
                continue
            have = len(parent.prompt_logprobs)
            assert first <= have, "prompt logprobs arrived with a gap"
            # A request recomputed after preemption covers tokens it already reported.
            new = entries[have - first:]
            self._name_logprobs(new)
            parent.prompt_logprobs.extend(new)
            touched.add(parent_id)
        return touched

    def _apply_tokens(self, updated: list[Request], result: ModelRunnerOutput) -> set[str]:
        lp_by_req = dict(zip(result.req_ids, result.logprobs, strict=True))
        slp_by_req = dict(zip(result.req_ids, result.sampled_logprobs, strict=True))
        touched = set()
        for req in updated:
            entry = self._child_to_parent.get(req.request_id)
            if entry is None:  # a sibling sequence failed this step: the request is gone
                continue
            parent_id, index = entry
            seq = self._parents[parent_id].seqs[index]
            # what the scheduler took of the step's tokens: a stop (or the length) inside
            # a speculative step's accepted drafts leaves the rest out
            num_new = req.num_new_tokens
            sampled_lps = slp_by_req[req.request_id][:num_new]
            step_lps = (lp_by_req[req.request_id] or [])[:num_new]
            seq.cumulative_logprob += sum(sampled_lps)
            if seq.logprobs is not None and step_lps:
                self._name_logprobs(step_lps)
                seq.logprobs.extend(step_lps)
            self.stats.generation_tokens_total += num_new
            try:
                unused = self._detokenize(seq, req, num_new)
            except Exception as err:  # this request's own failure: end it, not the step
                self._fail_request(parent_id, err)
                continue
            if unused:  # accepted tokens after a stop string's last: not part of the output
                del req.output_token_ids[-unused:]
                seq.cumulative_logprob -= sum(sampled_lps[-unused:])
                if seq.logprobs is not None and step_lps:
                    del seq.logprobs[-unused:]
                self.stats.generation_tokens_total -= unused
            touched.add(parent_id)
        return touched

    def _name_logprobs(self, entries: list[dict[int, Logprob] | None]) -> None:
        """Give each logprob its token's own text (vLLM's ``decoded_token``: the token
        decoded alone), from a cache that the vocabulary bounds."""
        cache = self._token_texts
        if self.tokenizer is None:  # skip_tokenizer_init: no text (decoded_token None)
            return
        for entry in entries:
            for tok, lp in (entry or {}).items():
                text = cache.get(tok)
                if text is None:
                    text = cache[tok] = self.tokenizer.decode([tok])
                if isinstance(lp, Logprob):
                    lp.decoded_token = text

    def _fail_request(self, parent_id: str, err: Exception) -> None:
        """End one request after an error that belongs to it alone; the caller learns of
        it from :meth:`pop_failed_requests`."""
        logger.error("request %s failed: %r", parent_id, err)
        if self.abort_request(parent_id):
            self._failed.append((parent_id, "this request failed while its output was being "
                                            "prepared; it was aborted"))

    def pop_failed_requests(self) -> list[tuple[str, str]]:
        """(request id, message) of requests ended by their own errors since the last call."""
        failed, self._failed = self._failed, []
        return failed

    def _detokenize(self, seq: SequenceState, req: Request, num_new: int) -> int:
        """Add the step's new tokens to the sequence's text; a stop string in it ends the
        request, also one this step ended by a stop token or length after the string (a
        speculative step accepts several tokens), as plain decoding would have ended it.
        Returns how many of the new tokens came after the string's last: the caller drops
        them."""
        if not req.sampling_params.detokenize:  # token ids only
            return 0
        new_tokens = req.output_token_ids[-num_new:]
        num_set_aside = 0
        params = req.sampling_params
        if req.status is RequestStatus.FINISHED_STOPPED and not isinstance(
                req.stop_reason, str) and not params.include_stop_str_in_output:
            # a stop token (or EOS) adds no text, unless stop text is asked for (vLLM's)
            new_tokens, num_set_aside = new_tokens[:-1], 1
        if not new_tokens:
            return 0
        stop = seq.detok.add_tokens(new_tokens)
        if stop is None:
            return 0
        if req.is_finished:
            req.status = RequestStatus.FINISHED_STOPPED
        else:
            self.scheduler.finish(req, RequestStatus.FINISHED_STOPPED)
        req.stop_reason = stop
        return seq.detok.num_unused + num_set_aside

    def _update_gauges(self) -> None:
        s, sched = self.stats, self.scheduler
        s.num_running = len(sched.running)
        s.num_waiting = len(sched.waiting)
        s.kv_cache_usage = sched.kv.usage
        s.prefix_cache_queries = sched.kv.stats.queries
        s.prefix_cache_hits = sched.kv.stats.hits
        s.num_preemptions = sched.num_preemptions
        s.num_priority_preemptions = sched.num_priority_preemptions
        s.num_swapped = len(sched.swap)
        s.num_swaps_out = sched.swap.num_swaps_out
        s.num_swaps_in = sched.swap.num_swaps_in
        s.spec_decode_num_draft_tokens = sched.num_draft_tokens
        s.spec_decode_num_accepted_tokens = sched.num_accepted_tokens
        s.async_placeholder_tokens = sched.num_placeholders
        s.async_wasted_tokens = sched.num_wasted_placeholders
        if self.kv_tier is not None:
            s.kv_tier = dataclasses.asdict(sched.tier.stats)
        if self.loras is not None:
            lora = self.loras.stats
            s.lora_requests = dict(lora.requests)
            s.num_loras_resident = len(sched.lora_slots)
            s.num_loras_registered = lora.num_registered
            s.num_lora_loads = lora.num_reads
            s.lora_load_seconds = lora.read_seconds
            s.num_lora_fetches = lora.num_fetched
        self.published_stats = dataclasses.replace(s)  # one reference swap: atomic

    def _drop(self, request_id: str) -> None:
        parent = self._parents.pop(request_id)
        for seq in parent.seqs:
            self._child_to_parent.pop(seq.request.request_id, None)
