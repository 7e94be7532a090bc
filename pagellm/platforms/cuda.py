"""NVIDIA GPUs through a CUDA build of torch."""

from __future__ import annotations

import torch

from pagellm.core.config import EngineConfig
from pagellm.core.errors import ConfigError
from pagellm.core.platform import DTYPE_VIEWS, FLOAT8, FP8_MATMUL, Availability, Platform
from pagellm.platforms._common import TorchRuntimePlatform, classproperty, hidden_by, triton_capability
from pagellm.plugins.hookspecs import hookimpl

PAGELLM_PLUGIN_API = "1.0"

BF16_CAPABILITY = (8, 0)
"""bfloat16 arithmetic needs Ampere or newer."""


def _torch_cuda_version() -> str | None:
    return torch.version.cuda


def _torch_hip_version() -> str | None:
    return getattr(torch.version, "hip", None)


def _cuda_device_count() -> int:
    """Visible devices; torch asks NVML first, so this creates no CUDA context."""
    return torch.cuda.device_count()


class CudaPlatform(TorchRuntimePlatform):
    name = "cuda"
    device_type = "cuda"
    dist_backend = "nccl"
    runtime = "cuda"
    priority = 100
    attention_backends = ("FLASH_ATTN", "TRITON_ATTN", "FLEX_ATTENTION", "TORCH_SDPA")

    @classproperty
    def capabilities(cls) -> frozenset[str]:
        """float8 casts and dtype views; torch._scaled_mm (from compute capability 8.9: a method that
        needs it says so in `min_capability` too); triton where installed. Read without touching a device."""
        return frozenset({FLOAT8, DTYPE_VIEWS, FP8_MATMUL}) | triton_capability()

    @classmethod
    def availability(cls) -> Availability:
        hip = _torch_hip_version()
        if hip:
            return Availability.no(f"this torch is a ROCm build (HIP {hip}); use --device rocm")
        cuda = _torch_cuda_version()
        if not cuda:
            return Availability.no(f"torch was built without CUDA (torch {torch.__version__})")
        count = _cuda_device_count()
        if count == 0:
            why = hidden_by(("CUDA_VISIBLE_DEVICES",)) or f"torch {torch.__version__} found no driver or GPU"
            return Availability.no(f"no NVIDIA device visible ({why})")
        return Availability.yes(f"found {count} NVIDIA device(s) (CUDA {cuda})")

    @classmethod
    def device_capability(cls, index: int = 0) -> tuple[int, int] | None:
        return torch.cuda.get_device_capability(index)

    supported_dtypes = (torch.bfloat16, torch.float16, torch.float32)
    default_dtype = torch.bfloat16
    """Facts of CUDA devices in general, read without touching one: reading them must not create a CUDA
    context before the platform is even selected. A device older than Ampere narrows them in
    `check_and_update_config`, which runs after selection."""

    @classmethod
    def check_and_update_config(cls, config: EngineConfig) -> None:
        super().check_and_update_config(config)
        capability = cls.device_capability()
        if capability < BF16_CAPABILITY:  # no bfloat16 arithmetic: auto means float16
            if config.dtype == "bfloat16":
                raise ConfigError(
                    f"dtype bfloat16 is not supported by {cls.device_name()} (compute capability "
                    f"{capability[0]}.{capability[1]}); supported here: float16, float32. Use --dtype float16."
                )
            if config.dtype == "auto":
                config.dtype = "float16"


@hookimpl
def pagellm_platforms() -> list[type[Platform]]:
    return [CudaPlatform]
