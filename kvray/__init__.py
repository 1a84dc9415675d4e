"""kvray: LLM inference and serving on Ray.

``from kvray import LLM, SamplingParams`` is the offline API.
"""

import os

# PyTorch's OpenMP threads spin at every barrier by default. A decode step runs hundreds of
# tiny parallel regions, so when any other process wants the same cores (the Serve ingress,
# Ray, a neighbour) each barrier can wait a whole scheduler slice: measured 20x slower steps
# with one busy neighbour on 2 cores, and none of that with passive waiting. OpenMP reads
# this when torch loads it, so it applies where kvray is imported before torch (the CLI,
# Serve replicas, worker actors); an explicit OMP_WAIT_POLICY is kept.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from kvray.config import ConfigError, EngineConfig, load_config
from kvray.outputs import CompletionOutput, RequestOutput
from kvray.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "CompletionOutput", "ConfigError", "EngineConfig", "RequestOutput",
           "SamplingParams", "load_config", "__version__"]


def __getattr__(name: str):
    # LLM pulls in torch and transformers; import it only when asked for.
    if name == "LLM":
        from kvray.engine.llm import LLM

        return LLM
    raise AttributeError(f"module 'kvray' has no attribute {name!r}")
