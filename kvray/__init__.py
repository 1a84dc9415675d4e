"""kvray: LLM inference and serving on Ray."""

from kvray.config import ConfigError, EngineConfig, load_config

__version__ = "0.1.0"
__all__ = ["ConfigError", "EngineConfig", "load_config", "__version__"]
