"""The Ray Serve application builder: one entry point for ``serve run``, ``serve deploy``
and KubeRay's ``serveConfigV2`` (``kvray serve`` calls the typed builder it leads to,
:func:`kvray.serve.app.build_serve_app`, directly).

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
  token fewer);
- ``name``: the Serve application's name (default ``kvray``; names its stats actor);
- ``use_gpu``: reserve a GPU per worker (true/false); default: whether the cluster has
  GPUs when the app is built — say it when GPU nodes may join later (KubeRay, autoscaling);
- ``api_key_file``: a file whose first line is the API key, read by the ingress replica
  (mount a Secret there); without it the ingress reads ``KVRAY_API_KEY`` from its own
  environment; ``api_key`` itself is accepted but lands in the Serve config in clear.

The arguments are parsed here once, into an :class:`~kvray.config.EngineConfig` and
:class:`~kvray.serve.options.ServeOptions`; nothing downstream parses them again.
"""

from __future__ import annotations

from typing import Any

from kvray.config import ConfigError, EngineConfig, load_config
from kvray.serve.options import ServeOptions

SERVE_ARGS = ("config", "num_replicas", "name", "api_key", "api_key_file", "use_gpu",
              "ingress")


def build_app(args: dict[str, Any] | None = None):
    """The Serve application for one model, from flat ``args`` (see the module doc);
    raises :class:`~kvray.config.ConfigError` naming a bad key or value."""
    from kvray.serve.app import build_serve_app

    args = dict(args or {})
    config_path = args.pop("config", None)
    options = _serve_options(args)  # before the model is looked up
    config = with_resolved_model(load_config(config_path, **args))
    return build_serve_app(config, options)


def _serve_options(args: dict[str, Any]) -> ServeOptions:
    """Take the Serve-level keys (all of :data:`SERVE_ARGS` but ``config``) out of ``args``."""
    try:
        num_replicas = int(args.pop("num_replicas", 1))
    except (TypeError, ValueError):
        raise ConfigError("num_replicas must be a positive integer") from None
    return ServeOptions(num_replicas=num_replicas,
                        ingress=str(args.pop("ingress", "separate")),
                        app_name=str(args.pop("name", "kvray")),
                        api_key=args.pop("api_key", None) or None,
                        api_key_file=args.pop("api_key_file", None) or None,
                        use_gpu=_parse_use_gpu(args.pop("use_gpu", None)))


def _parse_use_gpu(value: Any) -> bool | None:
    if not isinstance(value, str):
        return value
    if value.lower() not in ("true", "false", "1", "0"):
        raise ConfigError(f"use_gpu = {value!r}: must be true or false")
    return value.lower() in ("true", "1")


def with_resolved_model(config: EngineConfig) -> EngineConfig:
    """``config`` with ``model`` set to the model's path on this machine (the built-in
    model's when unset); raises ConfigError when it does not exist."""
    from kvray.models.default_model import resolve_model_path, with_builtin_model

    config = with_builtin_model(config)
    model_path = resolve_model_path(config.model.model)
    if not model_path.exists():
        raise ConfigError(f"model path {model_path} does not exist")
    model = config.model.model_copy(update={"model": str(model_path)})
    return config.model_copy(update={"model": model})
