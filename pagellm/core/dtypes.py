"""The dtypes users name (`--dtype`, `LLM(dtype=...)`) and how pagellm prints them, defined once."""

from __future__ import annotations

import torch

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
"""Name -> torch dtype, for the names `--dtype` accepts besides `auto`."""


KV_CACHE_DTYPES: dict[str, torch.dtype] = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
"""Name -> torch dtype, for the names `--kv-cache-dtype` accepts besides `auto` (vLLM's names): one byte per
value halves the KV cache's memory and the bytes each decode step reads."""


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.bfloat16` -> `bfloat16`: the name users pass, for messages and logs."""
    return str(dtype).removeprefix("torch.")
