"""Iteration-level scheduler: every step re-decides the batch.

There is no prefill or decode phase: each request's ``num_computed_tokens`` catches up to
its ``num_tokens``, and the step's token budget (``max_num_batched_tokens``) decides how
far each advances. That gives chunked prefill and mixed prefill/decode batches.

Invariants relied on:
- a request is in exactly one of ``waiting`` / ``running`` / ``swap`` until it finishes;
- ``num_computed_tokens`` advances only when a step's output comes back
  (:meth:`update_from_output`), so a request preempted in the step that scheduled it has
  computed nothing new;
- when a step preempts to make room for running requests, it admits no waiting request (no
  thrash, and no request can hit a block that a preempted request keyed but never computed);
- under the priority policy a waiting request may preempt running requests of strictly lower
  priority (:meth:`Scheduler._preempt_for`), but only while no waiting request has been
  admitted in the step, and the step then admits that request and no other: a victim's only
  uncomputed blocks are the ones it keyed in this step, nobody admitted before it can hold
  them, and ``free`` drops their keys, so nothing admitted after it can hit them;
- under the priority policy no swapped request outranks a running one (victims go lowest
  first, swapped requests come back lowest (priority, arrival) first, and a waiting request
  is admitted past a swapped one only if it outranks it), so swapped requests never need to
  preempt.

Pipelined steps (``num_micro_batches`` > 1, for PP): up to that many scheduled steps may be
in flight before the first one's output returns. A request scheduled in a step is *in
flight* until :meth:`Scheduler.update_from_output` sees that step: later steps skip it and
never preempt it (its step still writes its blocks), so each step is a disjoint
micro-batch of at most ``ceil(min(active, max_num_seqs) / num_micro_batches)`` requests. A
running request short of blocks whose victim (in the usual order) is in flight sits the
step out instead of preempting another, so victims go in the same total order as without
pipelining. Workers run steps in
submission order, so a block a step keys before its K/V exists (a prefill in flight) is
written before any later step reads it, and blocks freed by an abort in flight are
rewritten only by later steps.

Async scheduling (``async_scheduling``): the engine schedules step N+1 while step N runs.
A running request that step N leaves one token short of what it knows (a decode, or the
last chunk of its prompt) is scheduled again in N+1 at the position past that token, which
no one has seen yet: N+1 names it in ``placeholder_req_ids`` and the workers feed it the
token step N sampled for it. A request scheduled ahead this way is in flight in at most one
step, the latest one; requests that need the real token before they can go on (drafts to
verify, a grammar's mask, a restore not yet confirmed) or that step N surely ends (its
``max_tokens`` or ``max_model_len``) wait for N's output instead. When the token ends the
request (a stop token or string), its ahead step is wasted work and its output is dropped.
A request that must preempt a victim in flight sets the scheduler *draining*: nothing is
scheduled ahead until no step is in flight, so the victim can be preempted then.
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from typing import TYPE_CHECKING

from kvray.config import EngineConfig
from kvray.errors import InvalidRequestError
from kvray.scheduler.kv_cache_manager import KVCacheManager
from kvray.scheduler.kv_tier import KVTier
from kvray.scheduler.lora_slots import LoRALoad, LoRASlots
from kvray.scheduler.output import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from kvray.scheduler.preemption import PreemptionCosts
from kvray.scheduler.queues import make_waiting_queue
from kvray.scheduler.request import Request, RequestStatus, next_draft_length
from kvray.scheduler.speculation import Speculation
from kvray.scheduler.step_plan import StepPlan
from kvray.scheduler.swap import SwapSpace
from kvray.scheduler.tier_traffic import TierTraffic

if TYPE_CHECKING:
    from kvray.lora.manager import LoRARegistry

class RequestTooLongError(InvalidRequestError):
    """The request can never be scheduled; the message says why (param: max_tokens)."""

    def __init__(self, message: str, param: str | None = "max_tokens") -> None:
        super().__init__(message, param)


class Scheduler:
    """Decides each step which requests advance by how many tokens, and owns their blocks."""

    def __init__(self, config: EngineConfig, num_blocks: int, max_model_len: int,
                 swap_capacity_blocks: int = 0, costs: PreemptionCosts | None = None,
                 loras: LoRARegistry | None = None, kv_tier: KVTier | None = None) -> None:
        """Limits and policies come from ``config``'s scheduler section, the block layout
        from its cache section, the steps in flight from its parallel section and drafts
        from its ``speculative_config``. The rest is what the engine learned at start-up:
        ``num_blocks`` and ``max_model_len`` from the workers, ``swap_capacity_blocks``
        from :func:`~kvray.scheduler.swap.swap_pool_blocks`, and ``costs`` (required by
        ``preemption_mode="auto"``) from timing the workers. ``kv_tier``: where evicted
        prefix blocks go and admissions fetch them from (:mod:`kvray.scheduler.kv_tier`)."""
        sched = config.scheduler
        if sched.preemption_mode == "auto" and costs is None:
            raise ValueError("preemption_mode='auto' needs the measured PreemptionCosts")
        self.config = sched
        self.max_model_len = max_model_len
        self.block_size = config.cache.block_size
        self.costs = costs
        self.kv = KVCacheManager.from_config(config.cache, num_blocks)
        self.waiting = make_waiting_queue(sched.scheduling_policy)
        self.running: list[Request] = []
        self.swap = SwapSpace(swap_capacity_blocks, sched.scheduling_policy)
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.num_swap_failures = 0  # swaps a worker could not store or restore: recomputed
        self._lost_since_last_step: set[str] = set()
        self.num_priority_preemptions = 0  # of which for a more important waiting request
        self._known_to_workers: set[str] = set()
        self._finished_since_last_step: set[str] = set()
        self._last_sent_len: dict[str, int] = {}
        self.num_micro_batches = config.parallel.num_micro_batches
        # req -> steps it is scheduled in whose output is not back, and their tokens
        self._in_flight: Counter[str] = Counter()
        self._in_flight_tokens: defaultdict[str, int] = defaultdict(int)
        self.async_scheduling = sched.async_scheduling
        self._latest_step: set[str] = set()  # the requests of the latest step submitted
        self._draining = False  # async: schedule nothing ahead until no step is in flight
        self.num_placeholders = 0  # async: tokens scheduled before they were sampled
        self.num_wasted_placeholders = 0  # of which the request had ended meanwhile
        self.speculation = Speculation.from_config(config.model.speculative_config)
        self.lookahead = self.speculation.lookahead  # KV slots a draft model writes ahead
        self.num_draft_tokens = 0  # speculative decoding: drafts verified
        self.num_accepted_tokens = 0  # of which accepted
        # LoRA: at most max_loras adapters among the running requests, each in a slot
        self.loras = loras
        self.lora_slots = LoRASlots(config.lora.max_loras) if loras is not None else None
        self._running_loras: Counter = Counter()  # lora id -> running requests
        self._lora_loads: list[LoRALoad] = []  # for the next SchedulerOutput
        # KV tier: lookups, fetches and copies out (None: no tier)
        self.tier = None if kv_tier is None else TierTraffic(
            kv_tier, self.kv, self.block_size, costs,
            write_through=config.cache.kv_offload_mode == "computed")

    # ---- admission -------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a request, or raise RequestTooLongError if it could never run."""
        self.check_request(request)
        if request.lora_id and self.loras is None:
            raise ValueError("this engine serves no LoRA adapters (enable_lora is off)")
        self.requests[request.request_id] = request
        self.waiting.add(request)
        if self.tier is not None:
            self.tier.queue(request)
        if request.lora_id:
            self.loras.retain(request.lora_id, self.loras.name_of(request.lora_id))

    def check_request(self, request: Request) -> None:
        """Raise RequestTooLongError if ``request`` could never be scheduled. A pooling
        request needs only its prompt's room: the one token it samples is dropped and
        never enters the cache."""
        n = request.num_prompt_tokens
        if n == 0:
            raise RequestTooLongError("the prompt is empty; give at least one token", "prompt")
        pools = request.sampling_params.pooling is not None
        need = n if pools else n + request.max_tokens
        asked = f"prompt ({n} tokens)" if pools else \
            f"prompt ({n} tokens) + max_tokens ({request.max_tokens}) = {need}"
        # what the caller must shorten: the prompt when it alone leaves no room to generate
        full = pools or n >= self.max_model_len
        param = "prompt" if full else "max_tokens"
        if need > self.max_model_len:
            raise RequestTooLongError(
                f"{asked} exceeds max_model_len ({self.max_model_len})"
                + ("; the prompt alone leaves no room for an output token"
                   if full and not pools else ""), param)
        capacity = self.kv.num_blocks * self.block_size - self.lookahead
        if need > capacity:
            raise RequestTooLongError(
                f"{asked} needs more KV cache than exists ({self.kv.num_blocks} blocks x "
                f"{self.block_size}" + (f" - {self.lookahead} kept for drafts"
                                        if self.lookahead else "")
                + f" = {capacity} tokens); raise kv_cache_memory or num_gpu_blocks_override",
                param)
        budget = self.config.max_num_batched_tokens
        if not self.config.enable_chunked_prefill and need > budget:
            # A preempted request re-prefills prompt + output in one step.
            raise RequestTooLongError(
                f"{asked} exceeds max_num_batched_tokens ({budget}) and chunked prefill is "
                "disabled", param)

    def has_unfinished_requests(self) -> bool:
        return bool(self.running) or bool(self.swap) or len(self.waiting) > 0

    def has_schedulable_requests(self) -> bool:
        """Whether a step scheduled now could run anything: a request not in flight."""
        return len(self.waiting) > 0 or bool(self.swap) or any(
            r.request_id not in self._in_flight or self._runs_ahead(r) for r in self.running)

    def _runs_ahead(self, req: Request) -> bool:
        """Async scheduling: whether the running ``req``, in flight in the latest step and
        no other, may be scheduled again before that step's output is back (see the module
        docstring for when it may not)."""
        rid = req.request_id
        if not self.async_scheduling or self._draining or self._in_flight[rid] != 1 \
                or rid not in self._latest_step:
            return False
        if self.speculation.configured or req.sampling_params.structured_outputs is not None \
                or self.kv.is_restoring(req):
            return False
        if req.num_computed_tokens + self._in_flight_tokens[rid] < req.num_tokens:
            return True  # mid-prompt: the next chunk's tokens are known
        # the step in flight samples its next token: it must not end the request for sure
        return len(req.output_token_ids) + 1 < req.max_tokens and \
            req.num_tokens + 1 < self.max_model_len

    # ---- one step --------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Decide this step: running requests first (preempting the least important when
        blocks run out), then swapped ones coming back, then new admissions. A step that
        preempts for running requests admits nothing, and a waiting request is admitted only
        if no swapped request of equal or higher priority (under fcfs: none at all) is
        waiting to come back."""
        out = SchedulerOutput(finished_req_ids=self._finished_since_last_step,
                              swap_drop=self.swap.take_drops(),
                              preempted_req_ids=self._lost_since_last_step)
        self._finished_since_last_step = set()
        self._lost_since_last_step = set()
        if not self._in_flight:
            self._draining = False
        if self.tier is not None:
            self.tier.look_up()
        plan = StepPlan(self.config.max_num_batched_tokens, self._micro_batch_size())
        self._schedule_running(plan, out)
        if not plan.preempted:
            self._schedule_swapped(plan, out)
            self._schedule_waiting(plan, out)
        self._fill_output(out, plan)
        for rid, num in plan.num_scheduled.items():
            self._in_flight[rid] += 1
            self._in_flight_tokens[rid] += num
        if not out.is_noop:  # a no-op is not submitted while steps are in flight
            self._latest_step = set(plan.num_scheduled)
        return out

    def _micro_batch_size(self) -> int:
        """Requests one step may take: all of them, or with pipelined steps an even share
        of the active ones, so that every step in flight has work."""
        if self.num_micro_batches == 1:
            return 1 << 30  # max_num_seqs bounds the running set, not the step
        active = min(len(self.running) + len(self.swap) + len(self.waiting),
                     self.config.max_num_seqs)
        return max(1, -(-active // self.num_micro_batches))

    def _schedule_running(self, plan: StepPlan, out: SchedulerOutput) -> None:
        i = 0
        while i < len(self.running) and not plan.full:
            req = self.running[i]
            ahead = 0  # its tokens in the step in flight (async scheduling)
            if req.request_id in self._in_flight:
                if not self._runs_ahead(req):
                    i += 1
                    continue
                ahead = self._in_flight_tokens[req.request_id]
            start = req.num_computed_tokens + ahead
            placeholder = bool(ahead) and start == req.num_tokens  # its next token flies
            num_new = min(req.num_tokens + placeholder - start, plan.budget)
            drafts = req.spec_token_ids[:plan.budget - 1] if not ahead and num_new == 1 \
                and self.speculation.wanted(len(self.running)) else []
            la = self.lookahead
            ids = self.kv.allocate_slots(req, num_new + len(drafts), lookahead=la) \
                if drafts else None
            if ids is None:  # no drafts, or no room for them: a plain step
                drafts = []
                ids = self.kv.allocate_slots(req, ahead + num_new, lookahead=la)
            preempted = False
            while ids is None:
                victim = self._pick_victim()
                if victim.request_id in self._in_flight:
                    # req waits for the victim's step to return, then preempts it; under
                    # async scheduling nothing runs ahead until then (the victim would be
                    # in flight again at every step)
                    self._draining = self.async_scheduling
                    break
                self._preempt(victim, plan, out)
                preempted = True
                if victim is req:
                    break
                ids = self.kv.allocate_slots(req, ahead + num_new, lookahead=la)
            if ids is None and req.status is not RequestStatus.RUNNING:
                continue  # req itself was preempted; running[i] is now the next request
            # Earlier victims shift req left (rare: only then search, else O(n^2) a step).
            i = self.running.index(req) + 1 if preempted else i + 1
            if ids is not None:
                plan.schedule(req, num_new + len(drafts), ids)
                if drafts:
                    plan.spec[req.request_id] = drafts
                if placeholder:
                    plan.placeholders.add(req.request_id)

    def _pick_victim(self) -> Request:
        """Lowest priority (largest value), then latest arrival. With pipelined steps it may
        be in flight: it cannot yield its blocks before its step returns, and the request
        needing them sits this step out rather than preempt a more important one (which
        could then preempt it back: a livelock)."""
        return max(self.running, key=Request.sort_key)

    def _outranks(self, a: Request, b: Request) -> bool:
        """Whether ``a`` may go before ``b`` (preempt it, or be admitted while it is
        swapped): only under the priority policy and only by a strictly lower priority
        value. Equal priority never does, so a victim can never preempt back the request
        it yielded to."""
        return self.config.scheduling_policy == "priority" and a.priority < b.priority

    def _preempt(self, req: Request, plan: StepPlan, out: SchedulerOutput) -> None:
        """Take ``req``'s blocks and any tokens it was given this step; save its K/V to the
        swap pool or let it recompute later, as :meth:`_should_swap` decides."""
        plan.unschedule(req)
        plan.preempted = True
        self._leave_running(req)
        num_saved = -(-req.num_computed_tokens // self.block_size)
        swap = self._should_swap(req, num_saved)  # before free: it reads the block table
        if swap:
            out.swap_out[req.request_id] = self.kv.block_ids(req.request_id)[:num_saved]
        self.kv.free(req)
        req.spec_token_ids = []
        req.num_preemptions += 1
        self.num_preemptions += 1
        self._known_to_workers.discard(req.request_id)
        out.preempted_req_ids.add(req.request_id)
        if swap:  # keeps num_computed_tokens: their K/V is in the pool
            self.swap.swap_out(req, num_saved)
        else:
            req.status = RequestStatus.PREEMPTED
            req.num_computed_tokens = 0
            if self.tier is not None:  # its blocks may be in the tier now: look again
                self.tier.queue(req)
            req.tier_noted = 0
            self.waiting.add_front(req)

    def _should_swap(self, req: Request, num_saved: int) -> bool:
        """Never under ``recompute`` or when the pool lacks room for ``num_saved`` blocks;
        always under ``swap``. Under ``auto``, never for a request that shares its prefix
        with a running one: it would come back into private copies of the shared blocks,
        needing more blocks than it gave up (measured: 0.63-0.77x of recompute's
        throughput on shared-prefix requests), while recomputing it finds the prefix
        cached. Otherwise when copying the blocks out and back costs less than recomputing
        its tokens."""
        mode = self.config.preemption_mode
        if mode == "recompute" or not self.swap.can_swap_out(num_saved):
            return False
        if mode == "swap":
            return True
        if self.kv.num_shared_prefix_tokens(req) > 0:
            return False
        return self.costs.prefers_swap(num_saved, req.num_computed_tokens)

    def _has_seq_room(self, plan: StepPlan) -> bool:
        return not plan.full and len(self.running) < self.config.max_num_seqs

    def _schedule_swapped(self, plan: StepPlan, out: SchedulerOutput) -> None:
        """Bring swapped requests back in the swap queue's order while blocks allow: fresh
        blocks, the saved K/V copied into them, and this step's tokens scheduled right away.
        A waiting request of higher priority goes first."""
        while self.swap and self._has_seq_room(plan):
            req = self.swap.peek()
            if len(self.waiting) and self._outranks(self.waiting.peek(), req):
                break
            if not self._lora_fits(req):
                break
            num_new = min(req.num_tokens - req.num_computed_tokens, plan.budget)
            ids = self.kv.allocate_slots(req, num_new, lookahead=self.lookahead,
                                         restoring=True)
            if ids is None:
                break
            out.swap_in[req.request_id] = ids[: req.num_swapped_blocks]
            self.swap.swap_in()
            self._admit(req, num_new, ids, plan)

    def _schedule_waiting(self, plan: StepPlan, out: SchedulerOutput) -> None:
        """Admit waiting requests in queue order while budget, slots and blocks allow. Under
        the priority policy the head may first preempt less important running requests;
        the step then admits it and no other."""
        while len(self.waiting) and not plan.full:
            req = self.waiting.peek()
            if self.swap and not self._outranks(req, self.swap.peek()):
                break  # a swapped request of equal or higher priority comes back first
            if not self._lora_fits(req):
                break  # its adapter waits for a slot (requests keep their order)
            admitted = self._admit_waiting(req, plan)
            if not admitted and self._preempt_for(req, plan, out):
                admitted = self._admit_waiting(req, plan)
            if not admitted or plan.preempted:
                break

    def _admit_waiting(self, req: Request, plan: StepPlan) -> bool:
        """Admit the waiting queue's head ``req`` if it gets a slot and blocks for this
        step's tokens (after its prefix-cache hits); False, changing nothing, if not."""
        if len(self.running) >= self.config.max_num_seqs:
            return False
        hits, num_hit = self.kv.find_cached_prefix(req)
        fetched = [] if self.tier is None else self.tier.run_for(req, len(hits))
        num_fetched = len(fetched) * self.block_size
        num_new = req.num_tokens - num_hit - num_fetched
        if not self.config.enable_chunked_prefill and num_new > plan.budget:
            return False
        num_new = min(num_new, plan.budget)
        ids = self.kv.allocate_slots(req, num_fetched + num_new, hits, lookahead=self.lookahead,
                                     restoring=bool(fetched))
        if ids is None:
            return False
        popped = self.waiting.pop()
        assert popped is req, "admitting a request that is not the queue's head"
        self.kv.count_lookup(req, num_hit)
        if fetched:
            self.tier.fetch(req, fetched, ids[len(hits):len(hits) + len(fetched)])
            num_hit += num_fetched
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = num_hit
        req.num_computed_tokens = num_hit
        if req.first_scheduled_time is None:
            req.first_scheduled_time = time.monotonic()
        plan.admitted_waiting = True
        self._admit(req, num_new, ids, plan)
        return True

    def _preempt_for(self, req: Request, plan: StepPlan, out: SchedulerOutput) -> bool:
        """Priority policy: preempt the running requests :meth:`_victims_for` names so that
        the waiting ``req`` fits. Returns whether any was preempted.

        Only before any waiting request is admitted in this step: one admitted earlier may
        hold a block a victim keyed this step but will not compute. The victims themselves
        were running when the step began, so every block they keyed before it is computed
        (a request swapped in this step ranks at or above ``req``, so it is never a victim:
        workers save before they restore, so it must not be swapped out in the same step).
        """
        if self.config.scheduling_policy != "priority" or plan.admitted_waiting:
            return False
        victims = self._victims_for(req, plan)
        for victim in victims:
            self._preempt(victim, plan, out)
        self.num_priority_preemptions += len(victims)
        return bool(victims)

    def _victims_for(self, req: Request, plan: StepPlan) -> list[Request]:
        """The fewest running requests of strictly lower priority than ``req``, lowest
        priority first, then latest arrival, whose preemption surely gives ``req`` a slot
        and its blocks in this step; [] if all of them would not be enough."""
        candidates = sorted((r for r in self.running if self._outranks(req, r)),
                            key=Request.sort_key, reverse=True)
        # Victims go in that order; one in flight cannot yield yet, and skipping it would
        # leave a swapped request outranking a running one.
        flying = [k for k, r in enumerate(candidates) if r.request_id in self._in_flight]
        if flying:
            # async scheduling: the victims run ahead at every step unless we drain
            self._draining = self.async_scheduling
            candidates = candidates[:flying[0]]
        _, num_hit = self.kv.find_cached_prefix(req)
        budget = plan.budget
        freed = self.kv.num_freed_by_prefixes(candidates)
        for k, (victim, num_freed) in enumerate(zip(candidates, freed, strict=True), start=1):
            budget += plan.num_scheduled.get(victim.request_id, 0)  # given back on preempt
            if self._fits_once_freed(req, num_hit, budget, k, num_freed):
                return candidates[:k]
        return []

    def _fits_once_freed(self, req: Request, num_hit: int, budget: int, num_victims: int,
                         num_freed: int) -> bool:
        """Whether ``req`` surely gets a slot and its blocks once ``num_victims`` running
        requests holding ``num_freed`` blocks alone are gone and ``budget`` tokens are left.
        It then takes at most the blocks covering ``min(num_tokens, num_hit + budget)``
        tokens: freeing victims can only shorten its cached prefix (their keyed but
        uncomputed blocks lose their keys), which never raises that bound."""
        if len(self.running) - num_victims >= self.config.max_num_seqs:
            return False
        if not self.config.enable_chunked_prefill and req.num_tokens - num_hit > budget:
            return False
        need = -(-(min(req.num_tokens, num_hit + budget) + self.lookahead) // self.block_size)
        return self.kv.pool.num_free + num_freed >= need

    def _admit(self, req: Request, num_new: int, block_ids: list[int], plan: StepPlan) -> None:
        """A waiting or swapped request joins the running batch with this step's tokens."""
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        plan.schedule(req, num_new, block_ids)
        if req.lora_id:
            self._running_loras[req.lora_id] += 1
            slot, load = self.lora_slots.acquire(req.lora_id, self._running_loras)
            if load:
                self._lora_loads.append(
                    LoRALoad(slot, req.lora_id, self.loras.payload(req.lora_id)))

    def _leave_running(self, req: Request) -> None:
        self.running.remove(req)
        if req.lora_id:
            self._running_loras[req.lora_id] -= 1
            if not self._running_loras[req.lora_id]:
                del self._running_loras[req.lora_id]

    def _lora_fits(self, req: Request) -> bool:
        """Whether ``req`` may join the running requests without a (max_loras + 1)-th
        adapter among them."""
        return not req.lora_id or req.lora_id in self._running_loras \
            or len(self._running_loras) < self.lora_slots.max_loras

    def _fill_output(self, out: SchedulerOutput, plan: StepPlan) -> None:
        out.spec_token_ids = plan.spec
        out.lora_loads, self._lora_loads = self._lora_loads, []
        if self.tier is not None:
            self.tier.fill(out)
        for req_id, num in plan.num_scheduled.items():
            req = self.requests[req_id]
            out.num_scheduled_tokens[req_id] = num
            if req_id not in self._known_to_workers:
                self._known_to_workers.add(req_id)
                out.new_requests.append(NewRequestData(
                    req_id, req.all_token_ids, req.num_prompt_tokens, req.sampling_params,
                    self.kv.block_ids(req_id), req.num_computed_tokens,
                    req.seed, self._slot_of(req)))
            else:
                # Workers got the whole prompt when the request was new: only outputs follow.
                sent = self._last_sent_len[req_id] - req.num_prompt_tokens
                assert sent >= 0
                out.cached_requests.append(CachedRequestData(
                    req_id, req.output_token_ids[sent:], plan.new_blocks[req_id],
                    req.num_computed_tokens + self._in_flight_tokens.get(req_id, 0)))
            # a placeholder's token reaches the workers from the step in flight
            self._last_sent_len[req_id] = req.num_tokens + (req_id in plan.placeholders)
        out.placeholder_req_ids = plan.placeholders
        self.num_placeholders += len(plan.placeholders)

    def _slot_of(self, req: Request) -> int:
        if not req.lora_id:
            return -1
        slot = self.lora_slots.slot(req.lora_id)
        assert slot is not None, "a running request's adapter has no slot"
        return slot

    # ---- results ---------------------------------------------------------------------
    def update_from_output(self, out: SchedulerOutput, result: ModelRunnerOutput
                           ) -> list[Request]:
        """Advance computed tokens, append sampled tokens, finish requests that hit a
        length or stop-token limit. Returns the requests that got new tokens."""
        sampled = dict(zip(result.req_ids, result.sampled_token_ids, strict=True))
        for rid, num in out.num_scheduled_tokens.items():
            self._in_flight[rid] -= 1
            self._in_flight_tokens[rid] -= num
            if not self._in_flight[rid]:
                del self._in_flight[rid], self._in_flight_tokens[rid]
        lost = self._recompute_lost(result.failed_swaps) if result.failed_swaps else set()
        if self.tier is not None:
            self.tier.note_computed(out, self.requests, lost | result.failed_swaps)
        updated = []
        for req_id, num in out.num_scheduled_tokens.items():
            req = self.requests.get(req_id)
            if req is None or req.is_finished or req_id in lost:
                # aborted (or, ahead, ended) while the step ran, or its KV was lost
                self.num_wasted_placeholders += req_id in out.placeholder_req_ids
                continue
            req.num_computed_tokens += num
            tokens = sampled.get(req_id) or []
            drafts = out.spec_token_ids.get(req_id)
            if drafts and tokens:  # KV past the accepted drafts is garbage: roll it back
                accepted = len(tokens) - 1
                req.num_computed_tokens -= len(drafts) - accepted
                self.num_draft_tokens += len(drafts)
                self.num_accepted_tokens += accepted
                req.spec_len = next_draft_length(len(drafts), accepted)
            if not tokens:
                continue
            if req.first_token_time is None:
                req.first_token_time = time.monotonic()
            req.num_new_tokens = 0
            for token in tokens:
                req.output_token_ids.append(token)
                req.num_new_tokens += 1
                if self._check_stop(req, token):
                    break  # the drafts accepted after it are not output
            updated.append(req)
            if not req.is_finished:
                req.spec_token_ids = self.speculation.drafts_for(
                    req, result.draft_token_ids.get(req_id), self.max_model_len)
        for req_id in out.swap_in:  # restored intact: their blocks may be hit from now on
            req = self.requests.get(req_id)
            if req is not None and req_id not in result.failed_swaps:
                self.kv.confirm_restored(req)
        if self.tier is not None:
            self.tier.results(out, result, self.requests, lost)
        return updated

    def _recompute_lost(self, failed: set[str]) -> set[str]:
        """Requests whose KV a worker could not save to the swap pool (or restore from it)
        start over by recompute, as if preempted that way. Returns those that ran in this
        step on the lost KV: their tokens from it are dropped. A request already in a
        later step in flight is left alone here: its restore there fails as well and is
        reported with that step."""
        rerun = set()
        for req_id in failed:
            req = self.requests.get(req_id)
            if req is None or req.is_finished:
                continue
            if req.status is RequestStatus.SWAPPED:
                self.swap.discard(req)
            elif req.status is RequestStatus.RUNNING and req_id not in self._in_flight:
                self._leave_running(req)
                req.num_computed_tokens = 0  # before free: none of its blocks stays keyed
                self.kv.free(req)
                self._known_to_workers.discard(req_id)
                self._lost_since_last_step.add(req_id)  # workers forget its state
                rerun.add(req_id)
            else:
                continue
            req.status = RequestStatus.PREEMPTED
            req.num_computed_tokens = 0
            self.waiting.add_front(req)
            self.num_swap_failures += 1
        return rerun

    def _check_stop(self, req: Request, token: int) -> bool:
        params = req.sampling_params
        n_out = len(req.output_token_ids)
        if n_out >= params.min_tokens and token in params.all_stop_token_ids:
            # vLLM's stop_reason: the stop token id, None at EOS
            req.stop_reason = token if token in params.stop_token_ids else None
            self.finish(req, RequestStatus.FINISHED_STOPPED)
        elif n_out >= req.max_tokens or req.num_tokens >= self.max_model_len:
            self.finish(req, RequestStatus.FINISHED_LENGTH)
        return req.is_finished

    def finish(self, req: Request, status: RequestStatus) -> None:
        """End a request (stop, length or abort) and free its blocks."""
        if req.is_finished:
            return
        if req.status is RequestStatus.RUNNING:
            self._leave_running(req)
        elif req.status is RequestStatus.SWAPPED:
            self.swap.discard(req)
        else:
            self.waiting.remove(req)
        self.kv.free(req)
        req.status = status
        req.finished_time = time.monotonic()
        self._known_to_workers.discard(req.request_id)
        self._last_sent_len.pop(req.request_id, None)
        self._finished_since_last_step.add(req.request_id)
        self.speculation.forget(req.request_id)
        del self.requests[req.request_id]
        if req.lora_id:
            self.loras.release(req.lora_id)

    def abort_request(self, request_id: str) -> bool:
        """Abort a queued, running or swapped request; False if it is unknown."""
        req = self.requests.get(request_id)
        if req is None:
            return False
        self.finish(req, RequestStatus.FINISHED_ABORTED)
        return True
