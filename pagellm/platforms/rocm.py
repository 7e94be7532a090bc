"""AMD GPUs through a ROCm build of torch, which drives them through the `torch.cuda` API."""

from __future__ import annotations

import os

import torch

from pagellm.core.platform import DTYPE_VIEWS, FLOAT8, Availability, Platform
from pagellm.platforms._common import TorchRuntimePlatform, classproperty, hidden_by, triton_capability
from pagellm.plugins.hookspecs import hookimpl

PAGELLM_PLUGIN_API = "1.0"

VISIBLE_DEVICE_VARIABLES = ("HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES")


def _torch_hip_version() -> str | None:
    return getattr(torch.version, "hip", None)


def _torch_cuda_version() -> str | None:
    return torch.version.cuda


def _path_exists(path: str) -> bool:
    return os.path.exists(path)


def _rocm_device_count() -> int:
    """Visible devices; torch asks amdsmi first, so this creates no HIP context."""
    return torch.cuda.device_count()


class RocmPlatform(TorchRuntimePlatform):
    name = "rocm"
    device_type = "cuda"
    dist_backend = "nccl"
    runtime = "cuda"
    priority = 100
    supported_dtypes = (torch.bfloat16, torch.float16, torch.float32)
    default_dtype = torch.bfloat16
    attention_backends = ("TRITON_ATTN", "FLEX_ATTENTION", "TORCH_SDPA")

    @classproperty
    def capabilities(cls) -> frozenset[str]:
        """float8 casts and dtype views; triton where installed. Not `fp8_matmul`: unverified here (MI300's
        torch._scaled_mm takes float8_e4m3fnuz, not the float8_e4m3fn that `fp8` checkpoints hold)."""
        return frozenset({FLOAT8, DTYPE_VIEWS}) | triton_capability()

    @classmethod
    def availability(cls) -> Availability:
        hip = _torch_hip_version()
        if not hip:
            cuda = _torch_cuda_version()
            if cuda:
                return Availability.no(f"this torch is a CUDA build (CUDA {cuda}); use --device cuda")
            return Availability.no(f"torch was built without ROCm (torch {torch.__version__})")
        if not _path_exists("/dev/kfd"):
            return Availability.no(
                "/dev/kfd is missing: the amdgpu kernel driver is not loaded, "
                "or the device is not passed into this container"
            )
        count = _rocm_device_count()
        if count == 0:
            why = hidden_by(VISIBLE_DEVICE_VARIABLES) or f"torch {torch.__version__} found no AMD GPU"
            return Availability.no(f"no AMD GPU visible ({why})")
        return Availability.yes(f"found {count} AMD GPU(s) (HIP {hip})")

    @classmethod
    def device_capability(cls, index: int = 0) -> tuple[int, int] | None:
        """The gfx architecture's major and minor (gfx942 -> (9, 4))."""
        return torch.cuda.get_device_capability(index)

    @classmethod
    def describe(cls) -> dict[str, str]:
        facts = super().describe()
        facts["arch"] = torch.cuda.get_device_properties(0).gcnArchName
        return facts


@hookimpl
def pagellm_platforms() -> list[type[Platform]]:
    return [RocmPlatform]
