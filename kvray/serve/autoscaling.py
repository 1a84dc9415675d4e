"""Engine replicas scaled by Ray Serve's autoscaler on kvray's own signals.

Each model replica reports, every ``autoscaling_interval_s``, the sequences its engine runs
and holds waiting (``kvray_sequences``, ``kvray_waiting``) and its KV cache usage
(``kvray_kv_usage``) (:meth:`kvray.serve.replica.LLMServer.record_autoscaling_stats`).
:class:`EngineLoadPolicy` asks for as many replicas as the load needs at
``target_ongoing_requests`` per replica, the load being the sequences the engines hold
(running, waiting, swapped) plus the requests queued at Serve's handles for a replica; and
for one more replica when some replica is full (KV usage above ``target_kv_usage`` with
sequences waiting). Serve's own count of ongoing requests is not the load: it includes the
output carriers (one open call per ingress and replica, :mod:`kvray.serve.transport`), which
would keep an idle application at two replicas. Serve applies min/max and the delays
around the policy; a replica it removes drains first (Serve stops routing to it and waits
up to ``graceful_shutdown_timeout_s`` for its requests to end).
"""

from __future__ import annotations

import math
from typing import Any

from kvray.config import AutoscalingConfig

SEQUENCES, WAITING, KV_USAGE = "kvray_sequences", "kvray_waiting", "kvray_kv_usage"
LOOK_BACK_PERIODS = 3  # the autoscaler averages this many reports of each replica


def serve_autoscaling_config(config: AutoscalingConfig) -> dict[str, Any]:
    """Serve's ``autoscaling_config`` for the model replicas (autoscaling on)."""
    return {
        "min_replicas": config.min_replicas,
        "max_replicas": config.max_replicas,
        "initial_replicas": config.initial_replicas,
        "target_ongoing_requests": config.target_ongoing_requests,
        "upscale_delay_s": config.upscale_delay_s,
        "downscale_delay_s": config.downscale_delay_s,
        "metrics_interval_s": config.autoscaling_interval_s,
        "look_back_period_s": LOOK_BACK_PERIODS * config.autoscaling_interval_s,
        "policy": {"policy_function": "kvray.serve.autoscaling:EngineLoadPolicy",
                   "policy_kwargs": {"target_kv_usage": config.target_kv_usage}},
    }


def desired_replicas(current: int, target: float, queued: float,
                     sequences: dict[Any, float], waiting: dict[Any, float],
                     kv_usage: dict[Any, float], target_kv_usage: float) -> int:
    """Replicas for this load (before Serve's bounds and delays): the engines'
    ``sequences`` plus the requests ``queued`` at the handles, at ``target`` per replica;
    and one more than ``current`` while a replica is full (KV above ``target_kv_usage``
    with sequences waiting)."""
    load = sum(sequences.values()) + queued
    wanted = math.ceil(load / target - 1e-9) if load > 0 else 0
    full = any(kv_usage.get(r, 0.0) > target_kv_usage and waiting.get(r, 0.0) > 0
               for r in kv_usage)
    if full:
        wanted = max(wanted, current + 1)
    return wanted


class EngineLoadPolicy:
    """Serve's policy hook, made once by Serve's controller with ``policy_kwargs`` and
    called with an :class:`ray.serve.config.AutoscalingContext` every control tick."""

    def __init__(self, target_kv_usage: float = 0.9) -> None:
        self.target_kv_usage = target_kv_usage

    def __call__(self, ctx: Any) -> tuple[int, dict]:
        if ctx.current_num_replicas == 0:  # scaled to zero: requests queue at the handles
            return (1 if ctx.total_num_requests > 0 else 0), {}
        metrics = ctx.aggregated_metrics or {}
        if SEQUENCES not in metrics:  # no replica has reported yet: hold
            return ctx.current_num_replicas, {}
        queued = float(getattr(ctx, "total_queued_requests", None) or 0)
        wanted = desired_replicas(
            ctx.current_num_replicas, ctx.config.get_target_ongoing_requests(), queued,
            metrics[SEQUENCES], metrics.get(WAITING, {}), metrics.get(KV_USAGE, {}),
            self.target_kv_usage)
        return wanted, {}
