"""`EngineConfig`: every engine setting, with the same names as the CLI flags and `LLM(...)` keywords.

The CLI builds its engine options from these fields (their `help` metadata), so a setting is declared
once. Platforms adjust it in `check_and_update_config`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


def _opt(default: Any, help: str, **extra: Any) -> Any:
    return field(default=default, metadata={"help": help, **extra})


@dataclass
class EngineConfig:
    model: str | None = _opt(
        None, "Hugging Face model directory or .gguf file; default: the embedded SmolLM2."
    )
    tokenizer: str | None = _opt(None, "Tokenizer directory (default: the model's).")
    gguf_file: str | None = _opt(None, "GGUF file name inside --model's directory.")
    dtype: str = _opt(
        "auto", "auto, float32, bfloat16 or float16.", choices=("auto", "float32", "bfloat16", "float16")
    )
    device: str = _opt(
        "auto", "Device platform (cpu, cuda, rocm, xpu, tpu or a plugin's), or auto.", envvar="PAGELLM_DEVICE"
    )
    attention_backend: str = _opt(
        "auto", "Attention backend name (see `pagellm plugins`), or auto.", envvar="PAGELLM_ATTENTION_BACKEND"
    )
    quantization: str | None = _opt(None, "Quantization method (see `pagellm plugins`).")
    block_size: int = _opt(16, "Tokens per KV-cache block.")
    max_model_len: int | None = _opt(None, "Longest prompt + output (default: the model's).")
    max_num_seqs: int = _opt(256, "Most requests in one step.")
    max_num_batched_tokens: int | None = _opt(None, "Token budget of one step (default 2048, at least 1).")
    enable_prefix_caching: bool = _opt(True, "Reuse KV blocks of shared prompt prefixes.")
    enable_chunked_prefill: bool = _opt(True, "Split long prompts across steps within the token budget.")
    scheduling_policy: str = _opt("fcfs", "fcfs or priority.", choices=("fcfs", "priority"))
    kv_cache_space: float | None = _opt(None, "GiB of memory for the KV cache on CPU (default 4).")
    gpu_memory_utilization: float = _opt(0.9, "Fraction of accelerator memory pagellm may use.")
    num_kv_blocks: int | None = _opt(
        None, "Exact number of KV-cache blocks, overriding the memory-based size."
    )
    seed: int = _opt(0, "Seed for sampling of requests that set none.")
    generation_config: str = _opt("auto", "auto: the model's generation_config.json defaults; pagellm: none.")
    tensor_parallel_size: int = _opt(1, "Number of devices to split the model over.")
    enforce_eager: bool = _opt(False, "Never compile or capture graphs.")

    def replace(self, **changes: Any) -> EngineConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """Build from keyword arguments, rejecting unknown names with the list of valid ones."""
        from pagellm.core.errors import ConfigError

        unknown = sorted(set(kwargs) - cls.field_names())
        if unknown:
            raise ConfigError(
                f"unknown engine setting(s) {', '.join(unknown)}; valid: {', '.join(sorted(cls.field_names()))}"
            )
        return cls(**kwargs)
