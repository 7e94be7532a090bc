"""Intel GPUs (Arc, Data Center GPU Max) through torch's built-in XPU support."""

from __future__ import annotations

import torch

from pagellm.core.platform import DTYPE_VIEWS, Availability, Platform
from pagellm.platforms._common import TorchRuntimePlatform, classproperty, hidden_by, triton_capability
from pagellm.plugins.hookspecs import hookimpl

PAGELLM_PLUGIN_API = "1.0"


def _xpu_compiled() -> bool:
    xpu = getattr(torch, "xpu", None)
    return xpu is not None and xpu._is_compiled()


def _xpu_device_count() -> int:
    """Visible devices; torch asks Level Zero Sysman first, so this starts no SYCL runtime."""
    return torch.xpu.device_count()


class XpuPlatform(TorchRuntimePlatform):
    name = "xpu"
    device_type = "xpu"
    dist_backend = "xccl"
    runtime = "xpu"
    priority = 90
    supported_dtypes = (torch.bfloat16, torch.float16, torch.float32)
    default_dtype = torch.bfloat16
    attention_backends = ("TRITON_ATTN", "FLEX_ATTENTION", "TORCH_SDPA")

    @classproperty
    def capabilities(cls) -> frozenset[str]:
        """dtype views; triton where installed (Intel's Triton backend). Not `float8`: torch's XPU kernels
        have lacked float8_e4m3fn support (casts, copies, elementwise ops), so `fp8` is refused here until
        this platform declares it."""
        return frozenset({DTYPE_VIEWS}) | triton_capability()

    @classmethod
    def availability(cls) -> Availability:
        if not _xpu_compiled():
            return Availability.no(f"torch was built without XPU (torch {torch.__version__})")
        count = _xpu_device_count()
        if count == 0:
            why = hidden_by(("ZE_AFFINITY_MASK",)) or "no Intel GPU or Level Zero driver found"
            return Availability.no(f"no Intel GPU visible ({why})")
        return Availability.yes(f"found {count} Intel GPU(s) (torch {torch.__version__})")


@hookimpl
def pagellm_platforms() -> list[type[Platform]]:
    return [XpuPlatform]
