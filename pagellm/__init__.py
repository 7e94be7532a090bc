"""pagellm: a fast LLM inference and serving engine."""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

try:
    __version__ = version("pagellm")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0.0.0"

_EXPORTS = {
    "AsyncLLM": "pagellm.engine.async_llm",
    "BeamSearchOutput": "pagellm.engine.beam_search",
    "BeamSearchParams": "pagellm.sampling.params",
    "BeamSearchSequence": "pagellm.engine.beam_search",
    "LLM": "pagellm.engine.llm",
    "CompletionOutput": "pagellm.engine.outputs",
    "EmbeddingOutput": "pagellm.engine.outputs",
    "EmbeddingRequestOutput": "pagellm.engine.outputs",
    "LoRARequest": "pagellm.lora.request",
    "PoolingParams": "pagellm.core.pooling",
    "PoolingRequestOutput": "pagellm.engine.outputs",
    "RequestOutput": "pagellm.engine.outputs",
    "SamplingParams": "pagellm.sampling.params",
    "StructuredOutputsParams": "pagellm.sampling.params",
}
"""The public names and their modules, imported on first use: `import pagellm` (and so the command line,
and `pagellm serve` before it starts its engine process) does not import torch until something needs it."""


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'pagellm' has no attribute {name!r}")


if TYPE_CHECKING:
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
