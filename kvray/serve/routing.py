"""Serve's request router for model replicas, able to send a call to one named replica.

An ingress reads each model replica's outputs for it on one carrier call
(``LLMServer.carry``), opened on the replica that admitted its requests: that call names
the replica in its ``replica`` keyword and goes there. A request for a LoRA adapter (Serve's
multiplexed model id) goes to the replicas that already serve that adapter while one has
room, else to those serving the fewest adapters (which then take it from the application's
directory). With ``routing: prefix`` (the default) a request goes to the replica likely to
hold the longest cached prefix of its prompt unless that one is much busier than the least
loaded (:mod:`kvray.serve.prefix_index`); with ``routing: load``, and for every other call,
to the less loaded of two random replicas, Serve's default policy (the router ranks the
two by their queue lengths).
"""

from __future__ import annotations

import random
from typing import Any

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from kvray.serve.prefix_index import PrefixIndex, block_hashes, pick_replica

# the model replica's methods that admit a request -> the position of their prompt argument
PROMPT_ARG = {"submit": 2, "generate": 1}


class ReplicaTargetRouter(RequestRouter):
    """Calls that name a replica (``replica=`` keyword) go to it while it is running and
    has room (otherwise elsewhere, and the caller sees where the call landed); requests
    go by their prompt's prefix (``routing="prefix"``) or to the less loaded of two random
    replicas."""

    def initialize_state(self, routing: str = "load", block_size: int = 16,
                         capacity_blocks: int = 1 << 16) -> None:
        """Serve passes ``request_router_kwargs`` here (see :func:`kvray.serve.app`)."""
        self.index = PrefixIndex(block_size, capacity_blocks) if routing == "prefix" else None

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        target = None
        if pending_request is not None:
            target = pending_request.kwargs.get("replica")
        if target is not None:
            for replica in candidate_replicas:
                if replica.replica_id.unique_id == target:
                    return [[replica]]
        adapter = pending_request.metadata.multiplexed_model_id \
            if pending_request is not None else ""
        ranks = [list(candidate_replicas)]
        if adapter and len(candidate_replicas) > 1:
            ranks = self._by_adapter(candidate_replicas, adapter)
        prompt = self._prompt_of(pending_request)
        if self.index is not None and prompt is not None:
            return await self._by_prefix(ranks, prompt, adapter)
        if adapter and len(candidate_replicas) > 1:
            return ranks
        if len(candidate_replicas) <= 2:
            return [list(candidate_replicas)]
        return [random.sample(candidate_replicas, 2)]

    # ---- prefix-aware routing ---------------------------------------------------------------
    @staticmethod
    def _prompt_of(pending_request: PendingRequest | None) -> list[int] | None:
        """The prompt token ids of a request's admitting call, else None."""
        at = PROMPT_ARG.get(pending_request.metadata.call_method) \
            if pending_request is not None else None
        if at is None:
            return None
        args = pending_request.args
        prompt: Any = args[at] if len(args) > at else None
        ids = prompt.get("prompt_token_ids") if isinstance(prompt, dict) else None
        return ids if isinstance(ids, list) else None

    async def _by_prefix(self, ranks: list[list[RunningReplica]], prompt: list[int],
                         adapter: str) -> list[list[RunningReplica]]:
        """``ranks[0]``'s replica with the longest prefix of ``prompt`` within the load
        slack first, then the rest of ``ranks`` (tried when it is full), and record that
        it was sent there."""
        first = ranks[0]
        hashes = block_hashes(prompt, self.index.block_size, adapter)
        loads = await self._loads(first)
        by_id = {r.replica_id.unique_id: r for r in first}
        self._forget_gone()
        chosen = pick_replica(list(by_id), self.index.match(hashes), loads)
        self.index.insert(hashes, chosen)
        rest = sorted((r for r in first if r.replica_id.unique_id != chosen),
                      key=lambda r: loads.get(r.replica_id.unique_id, 0))
        return [ranks_ for ranks_ in ([by_id[chosen]], rest, *ranks[1:]) if ranks_]

    async def _loads(self, replicas: list[RunningReplica]) -> dict[str, int]:
        """Ongoing requests per replica: Serve's cached queue lengths (bumped as requests
        are sent), probed where the cache has none."""
        loads, missing = {}, []
        for r in replicas:
            n = self.replica_queue_len_cache.get(r.replica_id)
            if n is None:
                missing.append(r)
            else:
                loads[r.replica_id.unique_id] = n
        if missing:
            for r, n in await self._probe_queue_lens(missing, 0):
                loads[r.replica_id.unique_id] = n if n is not None else 0
        return loads

    def _forget_gone(self) -> None:
        """Drop replicas Serve no longer runs from the index (their caches went with them)."""
        live = {rid.unique_id for rid in self.curr_replicas}
        for replica in self.index.replicas() - live:
            self.index.forget(replica)

    @staticmethod
    def _by_adapter(candidates: list[RunningReplica], adapter: str
                    ) -> list[list[RunningReplica]]:
        """Ranks for a request of LoRA ``adapter``: the replicas serving it, then those
        serving the fewest adapters, then the rest (a later rank is tried when the earlier
        ones are full)."""
        holders = [r for r in candidates if adapter in r.multiplexed_model_ids]
        others = [r for r in candidates if adapter not in r.multiplexed_model_ids]
        if not others:
            return [holders]
        fewest = min(len(r.multiplexed_model_ids) for r in others)
        light = [r for r in others if len(r.multiplexed_model_ids) == fewest]
        rest = [r for r in others if len(r.multiplexed_model_ids) != fewest]
        return [ranks for ranks in (holders, light, rest) if ranks]

