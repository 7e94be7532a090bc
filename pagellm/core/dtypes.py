"""The dtypes users name (`--dtype`, `LLM(dtype=...)`) and how pagellm prints them, defined once."""

from __future__ import annotations

import torch

from pagellm.core.dtype_names import DTYPE_NAMES, KV_CACHE_DTYPE_NAMES

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
"""Name -> torch dtype, for the names `--dtype` accepts besides `auto`."""
assert tuple(DTYPES) == DTYPE_NAMES


KV_CACHE_DTYPES: dict[str, torch.dtype] = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
}
"""Name -> torch dtype, for the names `--kv-cache-dtype` accepts besides `auto` (vLLM's names): one byte per
value halves the KV cache's memory and the bytes each decode step reads. int8 rows carry their own scale
(`INT8_SCALE_BYTES`)."""
assert tuple(KV_CACHE_DTYPES) == KV_CACHE_DTYPE_NAMES

INT8_SCALE_BYTES = 4
"""An int8 cache row is head_size values then their float32 scale (max |x| / 127, per token and KV head),
so the scale travels with the row through every block copy and gather."""


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.bfloat16` -> `bfloat16`: the name users pass, for messages and logs."""
    return str(dtype).removeprefix("torch.")
