"""The Serve application graph for one model, from a typed config: model replicas
(:mod:`kvray.serve.replica`) behind an OpenAI ingress, or the app inside the one model
replica (:mod:`kvray.serve.ingress`). The ``kvray.serve:build_app`` entry point
(:mod:`kvray.serve.builder`) parses its args dict and calls :func:`build_serve_app`.

Serve's own queues are bounded (``max_queued_requests``: beyond, callers get 503); the
engine admits by sequences.
"""

from __future__ import annotations

from typing import Any

from ray.serve import Application

from kvray.actors.executor import executor_backend
from kvray.actors.placement import worker_bundles
from kvray.config import EngineConfig
from kvray.serve.autoscaling import serve_autoscaling_config
from kvray.serve.ingress import LLMServerIngress, OpenAIIngress
from kvray.serve.options import ServeOptions, check_replicas, check_servable, served_model_name
from kvray.serve.replica import LLMServer

# Requests Serve's proxy may queue for the ingress. The ingress answers every request at
# once (admitted, or refused with OpenAI's JSON), so its queue only holds a burst while
# Serve's router assigns it: bounded, but far above what the engine admits, so that
# refusals come from kvray, not the proxy.
INGRESS_QUEUE = 8192


def build_serve_app(config: EngineConfig, options: ServeOptions) -> Application:
    """The Serve application for one model. ``config.model.model`` is the model's resolved
    path (see :func:`kvray.serve.builder.with_resolved_model`); ``config`` travels to the
    replicas as it is."""
    check_servable(config)
    check_replicas(config, options)
    model_name = served_model_name(config, config.model.model)
    replica = _replica_options(config, options)
    drain = config.server.drain_timeout_s
    front = {"max_queued_requests": INGRESS_QUEUE, "graceful_shutdown_timeout_s": drain + 10,
             **_backpressure()}
    if options.ingress == "replica":  # HTTP to this replica: the ingress' bounds apply
        return LLMServerIngress.options(name="LLMServer", **{**replica, **front}).bind(
            config, model_name, options)
    router = _replica_router(config)
    if router is not None:
        replica["request_router_config"] = router
    llm = LLMServer.options(**replica).bind(config, options.board_name)
    return OpenAIIngress.options(**front).bind(llm, config, model_name, options,
                                               router is not None)


def _replica_options(config: EngineConfig, options: ServeOptions) -> dict[str, Any]:
    """The model replica deployment's options: replicas, queue bound, drain time, and
    what each replica reserves (its workers' bundles, or a GPU for an in-replica engine)."""
    queue = config.server.max_waiting + config.scheduler.max_num_seqs
    replica: dict[str, Any] = {"max_queued_requests": queue,
                               "graceful_shutdown_timeout_s": config.server.drain_timeout_s + 5}
    if config.autoscaling.enabled:
        replica["autoscaling_config"] = serve_autoscaling_config(config.autoscaling)
    else:
        replica["num_replicas"] = options.num_replicas
    use_gpu = options.use_gpu
    if use_gpu is None:  # decided now: say it explicitly when GPU nodes join later
        import ray

        use_gpu = ray.is_initialized() and ray.cluster_resources().get("GPU", 0) > 0
    if executor_backend(config) == "ray":
        # The replica's bundle, then one per worker: Serve reserves the whole replica
        # (with STRICT_SPREAD the replica's own bundle needs a node of its own too).
        replica["placement_group_bundles"] = [{"CPU": 1}, *worker_bundles(config, use_gpu)]
        replica["placement_group_strategy"] = config.parallel.placement_strategy
    elif use_gpu:  # the engine runs in the replica itself: it holds the GPU
        replica["ray_actor_options"] = {"num_cpus": 1, "num_gpus": 1}
    return replica


def _backpressure() -> dict[str, Any]:
    """Ray >= 2.5x: the proxy's own refusals say when to retry (503 + Retry-After)."""
    try:
        from ray.serve.config import BackpressureConfig
    except ImportError:
        return {}
    return {"backpressure_config": BackpressureConfig(status_code=503, retry_after_s=1)}


def _replica_router(config: EngineConfig) -> Any:
    """The router that sends a carrier call to the replica it names (outputs on one
    carrier per model replica: see :mod:`kvray.serve.transport`) and each request by its
    prompt's prefix (``server.routing``), or None on a Ray without custom routers, where
    each request streams its outputs on its own call and Serve's default router picks."""
    try:
        from ray.serve.config import RequestRouterConfig

        from kvray.serve.routing import ReplicaTargetRouter
    except ImportError:
        return None
    kwargs = {"routing": config.server.routing, "block_size": config.cache.block_size,
              "capacity_blocks": config.cache.num_gpu_blocks_override or 1 << 16}
    return RequestRouterConfig(request_router_class=ReplicaTargetRouter,
                               request_router_kwargs=kwargs)
