"""pagellm: a fast LLM inference and serving engine."""

from importlib.metadata import PackageNotFoundError, version

from pagellm.core.pooling import PoolingParams
from pagellm.engine.async_llm import AsyncLLM
from pagellm.engine.beam_search import BeamSearchOutput, BeamSearchSequence
from pagellm.engine.llm import LLM
from pagellm.engine.outputs import (
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    PoolingRequestOutput,
    RequestOutput,
)
from pagellm.lora.request import LoRARequest
from pagellm.sampling.params import BeamSearchParams, SamplingParams, StructuredOutputsParams

try:
    __version__ = version("pagellm")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0.0.0"

__all__ = [
    "AsyncLLM",
    "BeamSearchOutput",
    "BeamSearchParams",
    "BeamSearchSequence",
    "LLM",
    "CompletionOutput",
    "EmbeddingOutput",
    "EmbeddingRequestOutput",
    "LoRARequest",
    "PoolingParams",
    "PoolingRequestOutput",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
    "__version__",
]
