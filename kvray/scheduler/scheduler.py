"""Iteration-level scheduler: every step re-decides the batch.

There is no prefill or decode phase: each request's ``num_computed_tokens`` catches up to
its ``num_tokens``, and the step's token budget (``max_num_batched_tokens``) decides how
far each advances. That gives chunked prefill and mixed prefill/decode batches.

Invariants relied on:
- a request is in exactly one of ``waiting`` / ``running`` until it finishes;
- ``num_computed_tokens`` advances only when a step's output comes back
  (:meth:`update_from_output`), so a request preempted in the step that scheduled it has
  computed nothing new;
- when a step preempts, it admits no waiting request (no thrash, and no request can hit a
  block that a preempted request keyed but never computed).
"""

from __future__ import annotations

import heapq
import time
from collections import deque

from kvray.config import CacheConfig, SchedulerConfig
from kvray.engine.request import Request, RequestStatus
from kvray.scheduler.kv_cache_manager import KVCacheManager
from kvray.scheduler.output import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)


class RequestTooLongError(ValueError):
    """The request can never be scheduled; the message says why."""


class WaitingQueue:
    """FCFS (deque; preempted requests go to the front) or priority (heap on
    (priority, arrival)) queue of waiting requests."""

    def __init__(self, policy: str) -> None:
        self.policy = policy
        self._deque: deque[Request] = deque()
        self._heap: list[tuple[int, float, int, Request]] = []
        self._counter = 0

    def __len__(self) -> int:
        return len(self._deque) + len(self._heap)

    def __iter__(self):
        return iter(self._deque) if self.policy == "fcfs" else (e[3] for e in self._heap)

    def add(self, request: Request, front: bool = False) -> None:
        if self.policy == "fcfs":
            self._deque.appendleft(request) if front else self._deque.append(request)
        else:
            self._counter += 1
            heapq.heappush(self._heap, (*request.sort_key(), self._counter, request))

    def peek(self) -> Request:
        return self._deque[0] if self.policy == "fcfs" else self._heap[0][3]

    def pop(self) -> Request:
        return self._deque.popleft() if self.policy == "fcfs" else heapq.heappop(self._heap)[3]

    def remove(self, request: Request) -> None:
        if self.policy == "fcfs":
            self._deque.remove(request)
        else:
            self._heap = [e for e in self._heap if e[3] is not request]
            heapq.heapify(self._heap)


class Scheduler:
    """Decides each step which requests advance by how many tokens, and owns their blocks."""

    def __init__(self, sched: SchedulerConfig, cache: CacheConfig, num_blocks: int,
                 max_model_len: int, swap_capacity_blocks: int = 0) -> None:
        self.config = sched
        self.swap_capacity_blocks = swap_capacity_blocks
        self.swap_used_blocks = 0
        self.swapped: deque[Request] = deque()
        self.num_swaps_out = 0
        self.num_swaps_in = 0
        self._swap_drop: set[str] = set()
        self.max_model_len = max_model_len
        self.block_size = cache.block_size
        self.kv = KVCacheManager(num_blocks, cache.block_size, cache.enable_prefix_caching)
        self.waiting = WaitingQueue(sched.scheduling_policy)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self._known_to_workers: set[str] = set()
        self._finished_since_last_step: set[str] = set()
        self._last_sent_len: dict[str, int] = {}

    # ---- admission -------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a request, or raise RequestTooLongError if it could never run."""
        self.check_request(request)
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def check_request(self, request: Request) -> None:
        """Raise RequestTooLongError if ``request`` could never be scheduled."""
        n = request.num_prompt_tokens
        if n == 0:
            raise RequestTooLongError("the prompt is empty; give at least one token")
        if n + request.max_tokens > self.max_model_len:
            raise RequestTooLongError(
                f"prompt ({n} tokens) + max_tokens ({request.max_tokens}) = "
                f"{n + request.max_tokens} exceeds max_model_len ({self.max_model_len})")
        capacity = self.kv.num_blocks * self.block_size
        if n + request.max_tokens > capacity:
            raise RequestTooLongError(
                f"prompt ({n} tokens) + max_tokens ({request.max_tokens}) needs more KV cache "
                f"than exists ({self.kv.num_blocks} blocks x {self.block_size} = {capacity} "
                "tokens); raise kv_cache_memory or num_gpu_blocks_override")
        budget = self.config.max_num_batched_tokens
        if not self.config.enable_chunked_prefill and n + request.max_tokens > budget:
            # A preempted request re-prefills prompt + output in one step.
            raise RequestTooLongError(
                f"prompt ({n} tokens) + max_tokens ({request.max_tokens}) exceeds "
                f"max_num_batched_tokens ({budget}) and chunked prefill is disabled")

    def has_unfinished_requests(self) -> bool:
        return bool(self.running) or bool(self.swapped) or len(self.waiting) > 0

    # ---- one step --------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_req_ids=self._finished_since_last_step,
                              swap_drop=self._swap_drop)
        self._finished_since_last_step, self._swap_drop = set(), set()
        budget = self.config.max_num_batched_tokens
        scheduled: dict[str, int] = {}
        new_blocks: dict[str, list[int]] = {}
        budget, preempted = self._schedule_running(budget, scheduled, new_blocks, out)
        if not preempted:
            budget = self._schedule_swapped(budget, scheduled, new_blocks, out)
        if not preempted and not self.swapped:  # swapped requests come back first
            self._schedule_waiting(budget, scheduled, new_blocks)
        self._fill_output(out, scheduled, new_blocks)
        return out

    def _schedule_running(self, budget, scheduled, new_blocks, out) -> tuple[int, bool]:
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            ids = self.kv.allocate_slots(req, num_new)
            while ids is None:
                victim = self._pick_victim()
                preempted = True
                budget += scheduled.pop(victim.request_id, 0)
                new_blocks.pop(victim.request_id, None)
                self._preempt(victim, out)
                if victim is req:
                    break
                ids = self.kv.allocate_slots(req, num_new)
            if ids is None:
                continue  # req itself was preempted; running[i] is now the next request
            i = self.running.index(req) + 1  # earlier victims shift it left
            scheduled[req.request_id] = num_new
            new_blocks[req.request_id] = ids
            budget -= num_new
        return budget, preempted

    def _pick_victim(self) -> Request:
        """Lowest priority (largest value), then latest arrival."""
        return max(self.running, key=Request.sort_key)

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        """Swap the victim out when asked and the pool has room, else recompute later."""
        self.running.remove(req)
        num_saved = -(-req.num_computed_tokens // self.block_size)
        swap = (self.config.preemption_mode == "swap" and num_saved > 0
                and self.swap_used_blocks + num_saved <= self.swap_capacity_blocks)
        if swap:
            out.swap_out[req.request_id] = self.kv.block_ids(req.request_id)[:num_saved]
        self.kv.free(req)
        req.num_preemptions += 1
        self.num_preemptions += 1
        self._known_to_workers.discard(req.request_id)
        out.preempted_req_ids.add(req.request_id)
        if swap:  # keeps num_computed_tokens: their K/V is in the pool
            req.status = RequestStatus.SWAPPED
            req.num_swapped_blocks = num_saved
            self.swap_used_blocks += num_saved
            self.num_swaps_out += 1
            self.swapped.append(req)
        else:
            req.status = RequestStatus.PREEMPTED
            req.num_computed_tokens = 0
            self.waiting.add(req, front=True)

    def _schedule_swapped(self, budget, scheduled, new_blocks, out) -> int:
        """Bring swapped requests back (oldest first) while blocks allow: fresh blocks, the
        saved K/V copied into them, and this step's tokens scheduled right away."""
        while self.swapped and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.swapped[0]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            ids = self.kv.allocate_slots(req, num_new)
            if ids is None:
                break
            self.swapped.popleft()
            out.swap_in[req.request_id] = ids[: req.num_swapped_blocks]
            self.swap_used_blocks -= req.num_swapped_blocks
            req.num_swapped_blocks = 0
            self.num_swaps_in += 1
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            scheduled[req.request_id] = num_new
            new_blocks[req.request_id] = ids
            budget -= num_new
        return budget

    def _schedule_waiting(self, budget, scheduled, new_blocks) -> None:
        while len(self.waiting) and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting.peek()
            hits, num_hit = self.kv.get_computed_blocks(req)
            num_new = req.num_tokens - num_hit
            if not self.config.enable_chunked_prefill and num_new > budget:
                break
            num_new = min(num_new, budget)
            ids = self.kv.allocate_slots(req, num_new, hits)
            if ids is None:
                break
            self.waiting.pop()
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit
            req.num_computed_tokens = num_hit
            req.status = RequestStatus.RUNNING
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.monotonic()
            self.running.append(req)
            scheduled[req.request_id] = num_new
            new_blocks[req.request_id] = ids
            budget -= num_new

    def _fill_output(self, out, scheduled, new_blocks) -> None:
        for req_id, num in scheduled.items():
            req = self.requests[req_id]
            out.num_scheduled_tokens[req_id] = num
            if req_id not in self._known_to_workers:
                self._known_to_workers.add(req_id)
                out.new_requests.append(NewRequestData(
                    req_id, req.all_token_ids, req.num_prompt_tokens, req.sampling_params,
                    self.kv.block_ids(req_id), req.num_computed_tokens,
                    req.seed))
            else:
                # Workers got the whole prompt when the request was new: only outputs follow.
                sent = self._last_sent_len[req_id] - req.num_prompt_tokens
                assert sent >= 0
                out.cached_requests.append(CachedRequestData(
                    req_id, req.output_token_ids[sent:], new_blocks[req_id],
                    req.num_computed_tokens))
            self._last_sent_len[req_id] = req.num_tokens

    # ---- results ---------------------------------------------------------------------
    def update_from_output(self, out: SchedulerOutput, result: ModelRunnerOutput
                           ) -> list[Request]:
        """Advance computed tokens, append sampled tokens, finish requests that hit a
        length or stop-token limit. Returns the requests that got new tokens."""
        sampled = dict(zip(result.req_ids, result.sampled_token_ids, strict=True))
        updated = []
        for req_id, num in out.num_scheduled_tokens.items():
            req = self.requests.get(req_id)
            if req is None or req.is_finished:
                continue  # aborted while the step ran
            req.num_computed_tokens += num
            tokens = sampled.get(req_id) or []
            if not tokens:
                continue
            if req.first_token_time is None:
                req.first_token_time = time.monotonic()
            for token in tokens:
                req.output_token_ids.append(token)
                if self._check_stop(req, token):
                    break
            updated.append(req)
        return updated

    def _check_stop(self, req: Request, token: int) -> bool:
        params = req.sampling_params
        n_out = len(req.output_token_ids)
        if n_out >= params.min_tokens and token in params.all_stop_token_ids:
            req.stop_reason = token
            self.finish(req, RequestStatus.FINISHED_STOPPED)
        elif n_out >= req.max_tokens or req.num_tokens >= self.max_model_len:
            self.finish(req, RequestStatus.FINISHED_LENGTH)
        return req.is_finished

    def finish(self, req: Request, status: RequestStatus) -> None:
        """End a request (stop, length or abort) and free its blocks."""
        if req.is_finished:
            return
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status is RequestStatus.SWAPPED:
            self.swapped.remove(req)
            self.swap_used_blocks -= req.num_swapped_blocks
            req.num_swapped_blocks = 0
            self._swap_drop.add(req.request_id)
        else:
            self.waiting.remove(req)
        self.kv.free(req)
        req.status = status
        req.finished_time = time.monotonic()
        self._known_to_workers.discard(req.request_id)
        self._last_sent_len.pop(req.request_id, None)
        self._finished_since_last_step.add(req.request_id)
        del self.requests[req.request_id]

    def abort_request(self, request_id: str) -> bool:
        req = self.requests.get(request_id)
        if req is None:
            return False
        self.finish(req, RequestStatus.FINISHED_ABORTED)
        return True
