"""Start-up resolution: plugins, device, model config, dtype, quantization and attention backend.

Everything here runs before any weight is read, so a wrong `--device` or `--attention-backend` fails in
under a second, and `pagellm plugins --explain MODEL` can print the same decision.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from pagellm.core.attention import AttentionBackend, AttentionSpec
from pagellm.core.config import EngineConfig
from pagellm.core.errors import ConfigError
from pagellm.core.platform import Platform
from pagellm.core.quant import QuantMethod
from pagellm.core.registry import Registry
from pagellm.core.selector import (
    BackendChoice,
    TimingCache,
    select_attention_backend,
    select_platform,
    select_quant_method,
)
from pagellm.engine.default_model import default_model_path
from pagellm.plugins import load_plugins

logger = logging.getLogger("pagellm")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ModelSource:
    directory: str  # a Hugging Face directory: config.json, tokenizer files, weights
    gguf_original: str | None = None  # the .gguf file the directory was converted from

    @property
    def gguf_file(self) -> str | None:
        return os.path.basename(self.gguf_original) if self.gguf_original else None


@dataclass
class EngineSetup:
    config: EngineConfig
    registry: Registry
    platform: type[Platform]
    source: ModelSource
    hf_config: Any
    model_class_path: str
    dtype: torch.dtype
    max_model_len: int
    spec: AttentionSpec
    backend_choice: BackendChoice
    quant_method: type[QuantMethod] | None
    explanation: list[str] = field(default_factory=list)

    @property
    def backend(self) -> type[AttentionBackend]:
        return self.backend_choice.backend


def cache_dir() -> str:
    """pagellm's cache folder (timings, converted checkpoints): PAGELLM_CACHE_DIR or ~/.cache/pagellm."""
    return os.environ.get("PAGELLM_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "pagellm"
    )


def resolve_model_source(config: EngineConfig) -> ModelSource:
    model = config.model or default_model_path()
    if model.endswith(".gguf"):
        if not os.path.isfile(model):
            raise ConfigError(f"--model {model}: no such GGUF file")
        return _gguf_source(os.path.abspath(model))
    if not os.path.isdir(model):
        raise ConfigError(
            f"--model {model}: not a local directory or .gguf file (pagellm loads models from disk; "
            f"download them first)"
        )
    if config.gguf_file:
        if not os.path.isfile(os.path.join(model, config.gguf_file)):
            raise ConfigError(f"--gguf-file {config.gguf_file}: not found in {model}")
        return _gguf_source(os.path.abspath(os.path.join(model, config.gguf_file)))
    if not os.path.isfile(os.path.join(model, "config.json")):
        raise ConfigError(
            f"--model {model}: no config.json there (or pass --gguf-file for a GGUF checkpoint)"
        )
    return ModelSource(os.path.abspath(model))


def _gguf_source(path: str) -> ModelSource:
    """A GGUF file is read through a converted Hugging Face copy (made once, cached); the file itself stays
    the source for methods that use its quantized tensors."""
    from pagellm.models.gguf import gguf_checkpoint_dir

    return ModelSource(str(gguf_checkpoint_dir(path, cache_dir())), gguf_original=path)


def load_hf_config(source: ModelSource) -> Any:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(source.directory)


def resolve_dtype(requested: str, hf_config: Any, platform: type[Platform], gguf: bool) -> torch.dtype:
    if requested != "auto":
        dtype = DTYPES[requested]
        if dtype not in platform.supported_dtypes:
            names = ", ".join(str(d).removeprefix("torch.") for d in platform.supported_dtypes)
            raise ConfigError(f"--dtype {requested} is not supported on {platform.name}; supported: {names}")
        return dtype
    checkpoint = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(checkpoint, str):
        checkpoint = DTYPES.get(checkpoint)
    if not gguf and checkpoint in platform.supported_dtypes and checkpoint != torch.float32:
        return checkpoint
    return platform.default_dtype


def resolve_max_model_len(requested: int | None, hf_config: Any) -> int:
    limit = None
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        if getattr(hf_config, key, None):
            limit = int(getattr(hf_config, key))
            break
    if requested is None:
        if limit is None:
            raise ConfigError("the model config states no maximum length; pass --max-model-len")
        return limit
    if limit is not None and requested > limit:
        raise ConfigError(f"--max-model-len {requested} exceeds the model's maximum of {limit} positions")
    return requested


def attention_spec(hf_config: Any, dtype: torch.dtype, block_size: int) -> AttentionSpec:
    """The attention shapes of a Hugging Face config (the most demanding layer's, for selection)."""
    num_heads = hf_config.num_attention_heads
    num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or num_heads
    head_size = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
    window = (
        getattr(hf_config, "sliding_window", None) if getattr(hf_config, "use_sliding_window", True) else None
    )
    return AttentionSpec(
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        dtype=dtype,
        block_size=block_size,
        sliding_window=window or None,
    )


def _backend_timer():
    if os.environ.get("PAGELLM_ATTENTION_TIMING", "1") == "0":
        return None
    from pagellm.attention_backends.timing import time_backend

    return time_backend


def resolve_engine(config: EngineConfig) -> EngineSetup:
    """Everything decided at start-up, before weights are read. Raises ConfigError with the fix."""
    if config.tensor_parallel_size != 1:
        raise ConfigError(
            f"--tensor-parallel-size {config.tensor_parallel_size}: tensor parallelism is not available yet; use 1"
        )
    registry = load_plugins()
    platform_choice = select_platform(registry, config.device)
    platform = platform_choice.platform
    platform.check_and_update_config(config)
    source = resolve_model_source(config)
    hf_config = load_hf_config(source)
    architectures = getattr(hf_config, "architectures", None) or []
    supported = [a for a in architectures if a in registry.models]
    if not supported:
        raise ConfigError(
            f"model architecture {', '.join(architectures) or '(none in config)'} is not supported; "
            f"supported: {', '.join(sorted(registry.models))}"
        )
    dtype = resolve_dtype(config.dtype, hf_config, platform, gguf=source.gguf_original is not None)
    max_model_len = resolve_max_model_len(config.max_model_len, hf_config)
    quant = select_quant_method(
        registry, platform, config.quantization, getattr(hf_config, "quantization_config", None)
    )
    spec = attention_spec(hf_config, dtype, config.block_size)
    backend_choice = select_attention_backend(
        registry,
        platform,
        spec,
        config.attention_backend,
        timer=_backend_timer(),
        cache=TimingCache(os.path.join(cache_dir(), "attention_timings.json")),
    )
    explanation = [
        *platform_choice.explanation,
        f"model {source.gguf_original or source.directory} ({supported[0]}), dtype {str(dtype).removeprefix('torch.')}, "
        f"max_model_len {max_model_len}",
        f"quantization {quant.name if quant else 'none'}",
        *backend_choice.explanation,
    ]
    return EngineSetup(
        config=config,
        registry=registry,
        platform=platform,
        source=source,
        hf_config=hf_config,
        model_class_path=registry.models[supported[0]],
        dtype=dtype,
        max_model_len=max_model_len,
        spec=spec,
        backend_choice=backend_choice,
        quant_method=quant,
        explanation=explanation,
    )
