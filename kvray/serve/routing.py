"""Serve's request router for model replicas, able to send a call to one named replica.

An ingress reads each model replica's outputs for it on one carrier call
(``LLMServer.carry``), opened on the replica that admitted its requests: that call names
the replica in its ``replica`` keyword and goes there. A request for a LoRA adapter (Serve's
multiplexed model id) goes to the replicas that already serve that adapter while one has
room, else to those serving the fewest adapters (which then take it from the application's
directory). Every other call goes to the less loaded of two random replicas, Serve's
default policy (the router ranks the two by their queue lengths).
"""

from __future__ import annotations

import random

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica


class ReplicaTargetRouter(RequestRouter):
    """Power of two choices, except for calls that name a replica (``replica=`` keyword):
    those go to it while it is running and has room; otherwise to two random ones, and the
    caller sees where the call landed."""

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
        if adapter and len(candidate_replicas) > 1:
            return self._by_adapter(candidate_replicas, adapter)
        if len(candidate_replicas) <= 2:
            return [list(candidate_replicas)]
        return [random.sample(candidate_replicas, 2)]

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

