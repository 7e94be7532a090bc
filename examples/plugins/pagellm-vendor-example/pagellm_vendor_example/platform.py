"""`vendor_sim`: a simulated accelerator. It answers like a vendor's device but runs on the host CPU."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

from pagellm.core.errors import ConfigError
from pagellm.core.platform import DTYPE_VIEWS, FLOAT8, Availability, GiB, Platform

if TYPE_CHECKING:
    from pagellm.core.config import EngineConfig

DISABLE_ENV = "VENDOR_SIM_DISABLE"
DEFAULT_KV_CACHE_GIB = 1.0


class VendorSimPlatform(Platform):
    name = "vendor_sim"
    device_type = "cpu"
    priority = -10  # a simulation: never chosen by --device auto over the real cpu platform
    supported_dtypes = (torch.float32, torch.bfloat16)
    default_dtype = torch.float32
    attention_backends = ("VENDOR_ATTN", "TORCH_SDPA")
    capabilities = frozenset({FLOAT8, DTYPE_VIEWS})
    """What its tensors (host torch tensors) can do; a quantization method that needs one of these (`fp8`:
    float8, `gguf`: dtype_views) runs here, one that needs anything else is refused with the reason. No
    method is named: a new one runs wherever its needs are declared."""

    @classmethod
    def availability(cls) -> Availability:
        if os.environ.get(DISABLE_ENV) == "1":
            return Availability.no(f"disabled by {DISABLE_ENV}=1")
        return Availability.yes("simulated device on the host CPU")

    @classmethod
    def device_name(cls, index: int = 0) -> str:
        return "VendorSim-1 (simulated)"

    @classmethod
    def total_memory(cls, index: int = 0) -> int:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    @classmethod
    def free_memory(cls, index: int = 0) -> int:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")

    @classmethod
    def kv_cache_bytes(cls, config: EngineConfig, model_bytes: int, peak_bytes: int) -> int:
        """The simulated device reserves a fixed KV-cache pool (`--kv-cache-space` GiB, default 1)."""
        return int((config.kv_cache_space or DEFAULT_KV_CACHE_GIB) * GiB)

    @classmethod
    def check_and_update_config(cls, config: EngineConfig) -> None:
        if config.tensor_parallel_size != 1:
            raise ConfigError(
                f"vendor_sim simulates a single device; set --tensor-parallel-size 1 "
                f"(got {config.tensor_parallel_size})"
            )

    @classmethod
    def describe(cls) -> dict[str, str]:
        return {
            "device": cls.device_name(),
            "runs on": "host CPU (simulation)",
            "total memory": f"{cls.total_memory() / GiB:.1f} GiB (host)",
            "free memory": f"{cls.free_memory() / GiB:.1f} GiB (host)",
            "default KV-cache pool": f"{DEFAULT_KV_CACHE_GIB:g} GiB",
        }
