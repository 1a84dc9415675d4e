"""Turns each incremental SchedulerOutput into tensors, runs the model, samples.

Keeps per-request state (token ids, block table, progress, generator) between steps, so
the scheduler only sends what changed.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from concurrent.futures import Future

import torch

from kvray.actors.cache_engine import CacheEngine
from kvray.actors.cuda_graphs import DecodeGraphs, capture_sizes
from kvray.actors.draft_runner import DraftRunner
from kvray.actors.grammar_masks import GrammarMasks
from kvray.actors.kv_sizing import new_kv_cache
from kvray.actors.prompt_outputs import Pooler, prompt_logprobs
from kvray.actors.step_sampler import StepSampler
from kvray.actors.step_state import CachedRequestState, StepInputs, placeholder_tokens
from kvray.actors.swap_pool import SwapPool
from kvray.config import EngineConfig
from kvray.kernels.attention import PagedRow, paged_batch
from kvray.kernels.plan import KernelPlan, choose_kernel_plan
from kvray.kernels.rotary import RotaryEmbedding
from kvray.lora.layers import LoRAModel, lora_kernel, resolve_lora_dtype
from kvray.models.expert_stats import count_expert_tokens
from kvray.models.kernel_install import install_kernel_plan
from kvray.models.loader import load_model, resolve_max_model_len
from kvray.parallel import ParallelContext
from kvray.scheduler.output import ModelRunnerOutput, SchedulerOutput
from kvray.scheduler.request import next_draft_length
from kvray.structured_output import Matcher

logger = logging.getLogger("kvray")


class ModelRunner:
    def __init__(self, config: EngineConfig, model_path: str, ctx: ParallelContext,
                 device: torch.device) -> None:
        self.config = config
        self.model_path = model_path
        self.ctx = ctx
        self.device = device
        self.model, self.spec = load_model(model_path, config.model.dtype, ctx,
                                           config.model.max_model_len, device,
                                           config.model.quantization, self.expert_loads)
        self.dtype = next(self.model.parameters()).dtype  # resolved once, by load_model
        self.max_model_len = resolve_max_model_len(config.model.max_model_len, self.spec)
        self.block_size = config.cache.block_size
        self.requests: dict[str, CachedRequestState] = {}
        self.pooler = Pooler()
        self.sampler = StepSampler(device, torch.Generator(device).manual_seed(config.model.seed))
        self.cache: CacheEngine | None = None
        self.swap_pool = SwapPool()
        self.graphs: DecodeGraphs | None = None
        # Host-side inputs go through pinned memory, copied without blocking the host.
        self.pin_memory = device.type == "cuda"
        self.grammar = GrammarMasks(model_path, config.model.tokenizer, self.spec.vocab_size,
                                    self.pin_memory)
        self.plan: KernelPlan = choose_kernel_plan(
            config.model.attention_backend, device, self.dtype, self.spec.torch_dtype,
            ctx.tp_size)
        installed = install_kernel_plan(self.model, self.plan)
        self.quantized = installed.quantized  # what this rank's shard holds quantized
        # Tokens routed to each expert (MoE models), counted on TP rank 0 of each stage only:
        # every TP rank routes the same tokens the same way.
        self.expert_tokens = count_expert_tokens(self.model, device) \
            if ctx.tp_rank == 0 else None
        if ctx.world_rank == 0:
            installed.log()
        self.lora: LoRAModel | None = None
        if config.lora.enabled:
            lora = config.lora
            dtype = resolve_lora_dtype(lora.lora_dtype, self.model, self.dtype,
                                       self.spec.torch_dtype)
            self.lora = LoRAModel(self.model, lora.max_loras, lora.max_lora_rank, dtype,
                                  device, lora_kernel(device,
                                                      self.attention_backend == "torch"))
            if ctx.world_rank == 0:
                logger.info("kvray: LoRA slots: %d adapters of rank <= %d in %s (%.0f MiB "
                            "on this worker)", lora.max_loras, lora.max_lora_rank,
                            str(dtype).removeprefix("torch."), self.lora.num_bytes / 2**20)
        self.drafter: DraftRunner | None = None
        spec = config.model.speculative_config
        if spec is not None and spec.method == "draft_model" and ctx.is_output_rank:
            self.drafter = DraftRunner(
                spec.model, self.dtype, self.max_model_len, self.spec.vocab_size,
                spec.num_speculative_tokens, device, self.kernels)
            installed = install_kernel_plan(self.drafter.model, self.plan.for_draft())
            if ctx.world_rank == 0:
                installed.log_huge_pages()

    @property
    def expert_loads(self) -> dict[int, list[int]] | None:
        """The measured per-layer expert loads ``expert_placement`` names (None: contiguous)."""
        loads = self.config.parallel.expert_placement
        return loads if isinstance(loads, dict) else None

    def release(self) -> None:
        """Drop what this runner holds on its device (CUDA graphs and their memory pool, the
        KV caches, the draft model, the weights) and hand the freed memory back to the
        device, so that another engine in this process gets it: on CUDA the next engine's
        ``gpu_memory_utilization`` budget counts every tensor the process still holds.
        Nothing runs on the runner afterwards."""
        self.graphs = None
        self.cache = None
        self.drafter = None
        self.expert_tokens = None
        self.requests.clear()
        self.sampler.generators.clear()
        self.pooler = Pooler()
        self.swap_pool = SwapPool()
        self.model = None
        self.grammar.shutdown()
        gc.collect()  # reference cycles in the model would keep its tensors until later
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    @property
    def kernels(self) -> dict:
        """The attention kernels picked, as :class:`AttentionMetadata` names them."""
        return self.plan.kernels

    @property
    def attention_backend(self) -> str:
        return self.plan.attention_backend

    # ---- KV cache ---------------------------------------------------------------------
    def initialize_cache(self, num_blocks: int) -> None:
        """Allocate ``num_blocks`` KV blocks (sized by :mod:`kvray.actors.kv_sizing`) and
        capture the decode graphs that read them."""
        graphs = self._decode_graphs_wanted()
        # CUDA graphs pad batches with rows that write to a block of their own, past the
        # ``num_blocks`` the block manager hands out.
        self.cache = new_kv_cache(self, num_blocks + graphs)
        self.graphs = None
        if self.drafter is not None:
            self.drafter.initialize_cache(num_blocks + graphs, self.block_size)
        if graphs:
            self._build_decode_graphs(pad_block=num_blocks)

    def _decode_graphs_wanted(self) -> bool:
        """Replay decode steps from CUDA graphs? On CUDA with kernels free of host syncs
        (triton), one worker (collectives stay eager), unless ``enforce_eager``. Not for MoE
        models: their layers read each expert's token count on the host to pick the experts
        that run, which a graph cannot capture (and a replay would not count tokens)."""
        return (self.device.type == "cuda" and not self.config.model.enforce_eager
                and self.attention_backend == "triton" and self.ctx.tp_size == 1
                and self.ctx.pp_size == 1 and not self.spec.num_experts)

    @torch.inference_mode()
    def _build_decode_graphs(self, pad_block: int) -> None:
        sizes = capture_sizes(self.config.scheduler.max_num_seqs,
                              requested=self.config.model.cuda_graph_sizes)
        if not sizes:
            return
        for module in self.model.modules():
            if isinstance(module, RotaryEmbedding):  # no host sync inside a graph
                module.fix_tables(self.max_model_len, self.device)
        # Only kernels free of host reads may be captured: the PyTorch reference reads the
        # sequence lengths on the host, and a graph would replay the capture's lengths
        # (wrong tokens, seen on an H200). Without them the padded batch runs eagerly.
        capture = self.device.type == "cuda" and self.attention_backend == "triton"
        start = time.perf_counter()
        free_before = torch.cuda.mem_get_info(self.device)[0] if capture else 0
        self.graphs = DecodeGraphs(
            self.model, self.cache.kv_caches, sizes, -(-self.max_model_len // self.block_size),
            self.block_size, pad_block, self.device, self.plan.decode_kernel,
            self.plan.write_kernel, capture=capture)
        if capture and self.ctx.world_rank == 0:
            used = free_before - torch.cuda.mem_get_info(self.device)[0]
            logger.info("kvray: captured %d CUDA graphs for decode batches of %s rows in "
                        "%.1f s (%.0f MiB)", len(sizes), f"{sizes[0]}..{sizes[-1]}",
                        time.perf_counter() - start, used / 2**20)

    # ---- per-request state --------------------------------------------------------------
    def _update_states(self, out: SchedulerOutput, prev: ModelRunnerOutput | None) -> None:
        for req_id in out.finished_req_ids:
            self.requests.pop(req_id, None)
            self.sampler.forget(req_id)
            self.pooler.forget(req_id)
            if self.drafter is not None:
                self.drafter.forget(req_id)
        for req_id in out.preempted_req_ids:
            self.requests.pop(req_id, None)
            if self.drafter is not None:
                self.drafter.forget(req_id)
        for new in out.new_requests:
            state = self.requests[new.req_id] = CachedRequestState(
                new.req_id, list(new.token_ids), new.num_prompt_tokens, new.sampling_params,
                list(new.block_ids), new.num_computed_tokens,
                list(new.token_ids[new.num_prompt_tokens:]),
                list(new.token_ids[:new.num_prompt_tokens]), lora_slot=new.lora_slot)
            if new.sampling_params.pooling is not None:
                self.pooler.add(new.req_id)
            if new.sampling_params.structured_outputs is not None and self.ctx.is_output_rank:
                state.matcher = self.grammar.matcher(new.sampling_params,
                                                     state.output_token_ids)
            self.sampler.add(new.req_id, new.seed)
        flying = placeholder_tokens(out, prev)
        for cached in out.cached_requests:
            state = self.requests[cached.req_id]
            new = cached.new_token_ids + flying.get(cached.req_id, [])
            state.token_ids.extend(new)
            state.output_token_ids.extend(new)
            if state.matcher is not None:
                state.matcher.accept(new)
            state.block_ids.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens

    # ---- inputs -------------------------------------------------------------------------
    def _prepare_inputs(self, out: SchedulerOutput) -> StepInputs:
        """The step's flat token batch. Attention sees *rows*: a prefill chunk is one row;
        a decode is a one-token row; a request verifying drafts becomes one one-token row
        per token (row j attends to its context plus the first j drafts: causal attention
        over the chunk, run by the decode kernels)."""
        sched = out.num_scheduled_tokens
        rows: list[PagedRow] = []
        req_ids = list(sched)
        sample_rows: list[int] = []
        plan: list[tuple[int, int]] = []  # per request: (its first row, its logits rows)
        for r, req_id in enumerate(req_ids):
            state, n = self.requests[req_id], sched[req_id]
            start = state.num_computed_tokens
            drafts = out.spec_token_ids.get(req_id, [])
            real_end = start + n - len(drafts)  # drafts follow the request's own tokens
            toks = state.token_ids[start:real_end] + drafts
            plan.append((len(rows), len(toks) if drafts else 1))
            if drafts:
                rows.extend(([tok], start + j, state.block_ids) for j, tok in enumerate(toks))
            else:
                rows.append((toks, start, state.block_ids))
            if real_end == len(state.token_ids):
                sample_rows.append(r)
        tokens, meta, row_last_token = paged_batch(rows, self.block_size, self._to_device,
                                                   **self.kernels)
        if self.lora is not None:
            self._set_lora_rows(req_ids, plan, rows, row_last_token, len(tokens))
        logits_index: list[int] = []
        first_rows: list[int] = []
        spans: dict[int, list[int]] = {}
        for i, r in enumerate(sample_rows):
            first, count = plan[r]
            first_rows.append(len(logits_index))
            logits_index.extend(row_last_token[first + j] for j in range(count))
            drafts = out.spec_token_ids.get(req_ids[r])
            if drafts:
                spans[i] = drafts
        token_starts = [row_last_token[first] - len(rows[first][0]) + 1 for first, _ in plan]
        return StepInputs(self._to_device(tokens), meta, req_ids, sample_rows,
                          self._to_device(logits_index), first_rows, spans, token_starts)

    def _set_lora_rows(self, req_ids: list[str], plan: list[tuple[int, int]],
                       rows: list, row_last_token: list[int], num_tokens: int) -> None:
        """Each token's adapter slot, for the model's LoRA layers (None: no adapter rows)."""
        slots = [self.requests[r].lora_slot for r in req_ids]
        if all(s < 0 for s in slots):
            self.lora.set_rows(None, self._to_device)
            return
        token_slots = [-1] * num_tokens
        for r, (first, count) in enumerate(plan):
            if slots[r] < 0:
                continue
            for row in range(first, first + count):
                end = row_last_token[row] + 1
                token_slots[end - len(rows[row][0]):end] = [slots[r]] * len(rows[row][0])
        self.lora.set_rows(token_slots, self._to_device)

    def _load_loras(self, out: SchedulerOutput) -> None:
        """Put the adapters the scheduler assigned to slots this step in place (their
        weights inline, or fetched once from the object store)."""
        for load in out.lora_loads:
            weights = load.weights
            if not isinstance(weights, dict):  # an object-store reference
                import ray
                weights = ray.get(weights)
            self.lora.load(load.slot, weights)

    def _to_device(self, data: list) -> torch.Tensor:
        """An int64 tensor of ``data`` on this worker's device; on CUDA built in pinned host
        memory and copied without blocking the host (the copy is queued before the kernels
        that read it on the same stream)."""
        host = torch.tensor(data, dtype=torch.int64, pin_memory=self.pin_memory)
        return host.to(self.device, non_blocking=self.pin_memory)

    # ---- one step -----------------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, out: SchedulerOutput, prev: ModelRunnerOutput | None = None
                      ) -> ModelRunnerOutput | None:
        """Run one step. Returns the sampled tokens on the last pipeline stage's TP rank 0
        (None elsewhere, unless a swap failed here: then an empty output that names the
        requests, for the executor to merge). ``prev``: the previous step's output (of the
        sampling rank), where ``out`` has placeholders (async scheduling)."""
        caches = self.cache.kv_caches
        # evicted blocks first: this step may write fetched or new K/V into them
        offloaded = self.swap_pool.copy_out(caches, out.kv_offload)
        self._swap(out)
        for req_id, blocks in out.kv_fetch.items():
            self.swap_pool.copy_in(req_id, caches, blocks, self.ctx.world_rank)
        if out.lora_loads:
            self._load_loras(out)
        result = self._execute(out, prev)
        failed = self.swap_pool.take_failed()
        if failed or offloaded:
            if result is None:
                result = ModelRunnerOutput([], [], [], [])
            result.failed_swaps = failed
            result.kv_offloaded = offloaded
        return result

    def _execute(self, out: SchedulerOutput, prev: ModelRunnerOutput | None
                 ) -> ModelRunnerOutput | None:
        self._update_states(out, prev)
        if out.is_empty:
            return ModelRunnerOutput([], [], [], []) if self.ctx.is_output_rank else None
        inputs = self._prepare_inputs(out)
        bitmask = self._start_bitmask(inputs)  # on another thread, while the forward runs
        hidden = self._forward(inputs)
        if hidden is None:
            return None  # not the last pipeline stage: activations went to the next one
        prompt_lps = prompt_logprobs(inputs, out, hidden, self.requests,
                                     self.model.compute_logits)
        logits = self.model.compute_logits(hidden[inputs.logits_index])
        if not self.ctx.is_output_rank:
            return None
        pooled = self.pooler.pool(inputs, out, hidden, self.requests,
                                  self.model.classify)
        states = [self.requests[inputs.req_ids[b]] for b in inputs.sample_rows]
        result = self.sampler.sample(inputs, states, logits, prompt_lps,
                                     bitmask.result() if bitmask is not None else None)
        result.pooled = pooled
        if self.drafter is not None:
            result.draft_token_ids = self._propose_drafts(out, result)
        return result

    def _propose_drafts(self, out: SchedulerOutput, result: ModelRunnerOutput
                        ) -> dict[str, list[int]]:
        """The draft model's drafts for each request that sampled, as many as the
        scheduler's adaptive length will take (:func:`next_draft_length`, the rule it
        applies too), so that no draft step is wasted."""
        jobs = []
        for req_id, toks in zip(result.req_ids, result.sampled_token_ids, strict=True):
            if not toks:
                continue
            drafts = out.spec_token_ids.get(req_id)
            if drafts:
                self.drafter.lengths[req_id] = next_draft_length(len(drafts), len(toks) - 1)
            state = self.requests[req_id]
            jobs.append((req_id, state.token_ids + toks, state.block_ids))
        return self.drafter.propose(jobs)

    # ---- structured outputs -------------------------------------------------------------
    def _start_bitmask(self, inputs: StepInputs) -> Future | None:
        """The next-token masks of the constrained requests that sample this step, one per
        logits row, filled while the forward runs (:class:`GrammarMasks`); a request
        verifying drafts gets a mask per draft position."""
        if not self.ctx.is_output_rank:
            return None
        plain: list[tuple[Matcher, int]] = []
        spec: list[tuple[Matcher, int, list[int]]] = []
        for i, b in enumerate(inputs.sample_rows):
            matcher = self.requests[inputs.req_ids[b]].matcher
            if matcher is None:
                continue
            if i in inputs.spans:
                spec.append((matcher, inputs.first_rows[i], inputs.spans[i]))
            else:
                plain.append((matcher, inputs.first_rows[i]))
        return self.grammar.start(plain, spec, inputs.logits_index.shape[0])

    def _forward(self, inputs: StepInputs) -> torch.Tensor | None:
        ctx = self.ctx
        hidden = residual = None
        if not ctx.is_first_stage:
            shape = (inputs.input_ids.shape[0], self.spec.hidden_size)
            hidden, residual = ctx.recv_from_prev_stage([shape, shape], self.dtype, self.device)
        with self._counting_experts(inputs.input_ids.shape[0]):
            result = self._run_model(inputs, hidden, residual)
        if ctx.is_last_stage:
            return result
        ctx.send_to_next_stage(list(result))
        return None

    def _run_model(self, inputs: StepInputs, hidden: torch.Tensor | None,
                   residual: torch.Tensor | None) -> torch.Tensor | tuple:
        """The forward, from a decode graph (pure-decode batches that fit one) or eagerly."""
        no_lora = self.lora is None or self.lora.batch.row_slots is None
        if self.graphs is not None and no_lora and \
                inputs.meta.num_decodes == len(inputs.meta.seq_lens_list):
            result = self.graphs.run(inputs.input_ids, inputs.meta)
            if result is not None:
                return result
        return self.model(inputs.input_ids, inputs.meta, hidden, residual,
                          kv_caches=self.cache.kv_caches)

    def _counting_experts(self, num_tokens: int) -> contextlib.AbstractContextManager:
        """Count the routing of the step's ``num_tokens`` real tokens (not a padded
        batch's pad rows) where this rank counts expert tokens."""
        if self.expert_tokens is None:
            return contextlib.nullcontext()
        return self.expert_tokens.counting(num_tokens)

    def take_expert_tokens(self) -> dict[int, list[int]]:
        """Tokens routed to each expert since the previous call, by global layer index
        (empty where this rank does not count: a dense model, TP ranks other than 0)."""
        return {} if self.expert_tokens is None else self.expert_tokens.take()

    def _swap(self, out: SchedulerOutput) -> None:
        """Save preempted requests' blocks before anyone reuses them, then restore the
        requests coming back, then forget copies that are no longer needed."""
        caches = self.cache.kv_caches
        for req_id, block_ids in out.swap_out.items():
            self.swap_pool.save(req_id, caches, block_ids)
        for req_id, block_ids in out.swap_in.items():
            self.swap_pool.restore(req_id, caches, block_ids)
        for req_id in out.swap_drop:
            self.swap_pool.drop(req_id)
