"""pagellm: a fast LLM inference and serving engine."""

from importlib.metadata import PackageNotFoundError, version

from pagellm.engine.async_llm import AsyncLLM
from pagellm.engine.llm import LLM
from pagellm.engine.outputs import CompletionOutput, RequestOutput
from pagellm.lora.request import LoRARequest
from pagellm.sampling.params import SamplingParams, StructuredOutputsParams

try:
    __version__ = version("pagellm")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0.0.0"

__all__ = [
    "AsyncLLM",
    "LLM",
    "CompletionOutput",
    "LoRARequest",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
    "__version__",
]
