"""How one model is served on Ray Serve, beside its :class:`~kvray.config.EngineConfig`:
replicas, which ingress, the application's name, the API key. No Ray here: ``kvray serve``
and the ``build_app`` entry point read it before Ray Serve is imported."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvray.config import ConfigError, EngineConfig

INGRESS_KINDS = ("separate", "replica")


def check_ingress(ingress: str, num_replicas: int) -> None:
    """Raise ConfigError unless ``ingress`` is a known kind that fits ``num_replicas``."""
    if ingress not in INGRESS_KINDS:
        raise ConfigError(f"ingress = {ingress!r}: must be one of {', '.join(INGRESS_KINDS)}")
    if ingress == "replica" and num_replicas != 1:
        raise ConfigError(f"ingress = 'replica' serves one model replica (num_replicas = "
                          f"{num_replicas}); use ingress = 'separate' for data parallelism")


def check_servable(config: EngineConfig) -> None:
    """Raise ConfigError for engine settings the HTTP server cannot work with."""
    if config.model.skip_tokenizer_init:
        raise ConfigError("skip_tokenizer_init: the HTTP server tokenizes prompts and "
                          "detokenizes outputs; it is for the offline LLM engine only")


def check_replicas(config: EngineConfig, options: ServeOptions) -> None:
    """Raise ConfigError when autoscaling (``max_replicas``) meets a fixed replica count
    or a front end that serves one replica."""
    if not config.autoscaling.enabled:
        return
    if options.num_replicas != 1:
        raise ConfigError(f"num_replicas = {options.num_replicas} and max_replicas = "
                          f"{config.autoscaling.max_replicas}: give a fixed num_replicas or "
                          "min_replicas/max_replicas (autoscaling), not both")
    if options.ingress == "replica" and config.autoscaling.max_replicas != 1:
        raise ConfigError("ingress = 'replica' serves one model replica: autoscaling "
                          f"(max_replicas = {config.autoscaling.max_replicas}) needs "
                          "ingress = 'separate'")


@dataclass(frozen=True)
class ServeOptions:
    """The Serve application's settings that are not the engine's (validated when built).

    ``ingress``: ``separate`` (an OpenAI ingress deployment in front of the model replicas)
    or ``replica`` (the app inside the one model replica: one Ray hop per streamed token
    fewer). ``use_gpu``: each worker (or the replica itself, TP x PP = 1) reserves a GPU;
    None = whether the cluster has GPUs when the app is built. ``api_key_file``: read by
    the ingress replica (a mounted Secret); without a key either, the ingress reads
    ``KVRAY_API_KEY`` from its own environment."""

    num_replicas: int = 1
    ingress: str = "separate"
    app_name: str = "kvray"
    api_key: str | None = None
    api_key_file: str | None = None
    use_gpu: bool | None = None

    def __post_init__(self) -> None:
        if self.num_replicas < 1:
            raise ConfigError(f"num_replicas = {self.num_replicas}: must be >= 1")
        check_ingress(self.ingress, self.num_replicas)

    @property
    def board_name(self) -> str:
        """The name of this application's stats actor (see :mod:`kvray.serve.stats_board`)."""
        return f"kvray-stats-{self.app_name}"


def served_model_name(config: EngineConfig, model_path: str | Path) -> str:
    """``served_model_name``, else the model directory's (or GGUF file's) name."""
    if config.model.served_model_name:
        return config.model.served_model_name
    path = Path(model_path)
    return path.stem if path.suffix == ".gguf" else path.name
