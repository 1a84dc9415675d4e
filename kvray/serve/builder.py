"""The Ray Serve application builder: one entry point for ``kvray serve``, ``serve run``,
``serve deploy`` and KubeRay's ``serveConfigV2``.

    serve run kvray.serve:build_app model=/models/llama tensor_parallel_size=2
    serve run configs/serve/smollm2.yaml          # import_path: kvray.serve:build_app

Arguments are the flat model-config keys of ``kvray serve`` (``model``, ``dtype``,
``tensor_parallel_size``, ``max_waiting`` ...; strings from the command line are converted
and validated like the YAML file), plus:

- ``config``: a flat model YAML on the machine that builds the app; keys given beside it
  override it;
- ``num_replicas``: model replicas (data parallelism), default 1;
- ``ingress``: ``separate`` (default: an OpenAI ingress deployment in front of the model
  replicas; it outlives a killed replica and ends its streams with an error event) or
  ``replica`` (one model replica that serves the HTTP API itself: one Ray hop per streamed
  token fewer, ~1.2x the output rate at 16 streams on 2 cores);
- ``name``: the Serve application's name (default ``kvray``; names its stats actor);
- ``use_gpu``: reserve a GPU per worker (true/false); default: whether the cluster has
  GPUs when the app is built — say it when GPU nodes may join later (KubeRay, autoscaling);
- ``api_key_file``: a file whose first line is the API key, read by the ingress replica
  (mount a Secret there); without it the ingress reads ``KVRAY_API_KEY`` from its own
  environment; ``api_key`` itself is accepted but lands in the Serve config in clear.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvray.config import ConfigError, EngineConfig, load_config

SERVE_ARGS = ("config", "num_replicas", "name", "api_key", "api_key_file", "use_gpu",
              "ingress")


def served_model_name(config: EngineConfig, model_path: str | Path) -> str:
    """``served_model_name``, else the model directory's (or GGUF file's) name."""
    if config.model.served_model_name:
        return config.model.served_model_name
    path = Path(model_path)
    return path.stem if path.suffix == ".gguf" else path.name


def build_app(args: dict[str, Any] | None = None):
    """The Serve application for one model, from flat ``args`` (see the module doc);
    raises :class:`~kvray.config.ConfigError` naming a bad key or value."""
    from kvray.default_model import resolve_model_path
    from kvray.serve.deployment import build_app as build_graph
    from kvray.serve.deployment import check_ingress

    args = dict(args or {})
    config_path = args.pop("config", None)
    try:
        num_replicas = int(args.pop("num_replicas", 1))
    except (TypeError, ValueError):
        raise ConfigError("num_replicas must be a positive integer") from None
    if num_replicas < 1:
        raise ConfigError(f"num_replicas = {num_replicas}: must be >= 1")
    ingress = str(args.pop("ingress", "separate"))
    check_ingress(ingress, num_replicas)  # before the model is looked up
    name = str(args.pop("name", "kvray"))
    api_key = args.pop("api_key", None) or None
    api_key_file = args.pop("api_key_file", None) or None
    use_gpu = args.pop("use_gpu", None)
    if isinstance(use_gpu, str):
        if use_gpu.lower() not in ("true", "false", "1", "0"):
            raise ConfigError(f"use_gpu = {use_gpu!r}: must be true or false")
        use_gpu = use_gpu.lower() in ("true", "1")
    config = load_config(config_path, **args)
    model_path = resolve_model_path(config.model.model)
    if not model_path.exists():
        raise ConfigError(f"model path {model_path} does not exist")
    flat = {k: v for k, v in config.to_flat().items() if v is not None}
    flat["model"] = str(model_path)
    return build_graph(flat, str(model_path), served_model_name(config, model_path),
                       api_key, num_replicas, app_name=name, api_key_file=api_key_file,
                       use_gpu=use_gpu, ingress=ingress)
