"""kvray: LLM inference and serving on Ray.

``from kvray import LLM, SamplingParams`` is the offline API.
"""

from kvray.config import ConfigError, EngineConfig, load_config
from kvray.inputs import PromptType, TextPrompt, TokensPrompt
from kvray.lora.request import LoRARequest
from kvray.outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    Logprob,
    PoolingOutput,
    PoolingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from kvray.sampling_params import PoolingParams, SamplingParams, StructuredOutputsParams

__version__ = "0.1.0"
__all__ = ["LLM", "AsyncEngineArgs", "BeamSearchParams", "ClassificationOutput",
           "ClassificationRequestOutput", "CompletionOutput", "ConfigError", "EmbeddingOutput",
           "EmbeddingRequestOutput", "EngineArgs", "EngineConfig", "LLMEngine", "Logprob",
           "LoRARequest", "PoolingOutput", "PoolingParams", "PoolingRequestOutput",
           "PromptType", "RequestOutput", "SamplingParams", "ScoringOutput",
           "ScoringRequestOutput", "StructuredOutputsParams", "TextPrompt", "TokensPrompt",
           "load_config", "__version__"]


def __getattr__(name: str):
    # LLM pulls in torch and transformers; import it only when asked for.
    if name == "LLM":
        from kvray.engine.llm import LLM

        return LLM
    if name == "LLMEngine":
        from kvray.engine.llm_engine import LLMEngine

        return LLMEngine
    if name in ("EngineArgs", "AsyncEngineArgs"):
        from kvray import utils

        return getattr(utils, name)
    if name == "BeamSearchParams":  # the engine layer: imported when asked for
        from kvray.engine.beam_search import BeamSearchParams

        return BeamSearchParams
    raise AttributeError(f"module 'kvray' has no attribute {name!r}")
