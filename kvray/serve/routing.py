"""Serve's request router for model replicas, able to send a call to one named replica.

An ingress reads each model replica's outputs for it on one carrier call
(``LLMServer.carry``), opened on the replica that admitted its requests: that call names
the replica in its ``replica`` keyword and goes there. Every other call goes to the less
loaded of two random replicas, Serve's default policy (the router ranks the two by their
queue lengths).
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
        if len(candidate_replicas) <= 2:
            return [list(candidate_replicas)]
        return [random.sample(candidate_replicas, 2)]
