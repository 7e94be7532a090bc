"""Google TPUs through torch_xla and libtpu.

`availability()` only looks for the packages and the device nodes: importing torch_xla can start the
PJRT runtime and claim the chips, so it is imported only by the device queries, after selection.
"""

from __future__ import annotations

import glob
import importlib.metadata
import importlib.util
import os

import torch

from pagellm.core.platform import Availability, Platform
from pagellm.platforms._common import AcceleratorPlatform, gib
from pagellm.plugins.hookspecs import hookimpl

PAGELLM_PLUGIN_API = "1.0"

DEVICE_NODE_PATTERNS = ("/dev/accel*", "/dev/vfio/[0-9]*")
"""TPU v2-v4 chips appear as /dev/accelN, v5e and later as VFIO groups (/dev/vfio/vfio is not a chip)."""


def _has_module(name: str) -> bool:
    """Whether `name` is installed, without importing it."""
    return importlib.util.find_spec(name) is not None


def _glob(pattern: str) -> list[str]:
    return sorted(glob.glob(pattern))


def _dist_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "?"


def _has_libtpu() -> bool:
    """libtpu from its wheel, or a libtpu.so named by TPU_LIBRARY_PATH (how TPU VM images ship it)."""
    path = os.environ.get("TPU_LIBRARY_PATH")
    return _has_module("libtpu") or bool(path and os.path.isfile(path))


def _xla_memory(index: int) -> tuple[int, int]:
    """(free, total) bytes of one TPU device; torch_xla reports bytes since 2.5 and KiB before."""
    import torch_xla.core.xla_model as xm

    info = xm.get_memory_info(torch.device("xla", index))
    if "bytes_limit" in info:
        return info["bytes_limit"] - info["bytes_used"], info["bytes_limit"]
    return info["kb_free"] * 1024, info["kb_total"] * 1024


class TpuPlatform(AcceleratorPlatform):
    name = "tpu"
    device_type = "xla"
    priority = 80
    supported_dtypes = (torch.bfloat16, torch.float32)
    default_dtype = torch.bfloat16
    attention_backends = ("TORCH_SDPA",)
    capabilities = frozenset()
    """None of pagellm's: torch_xla has no kernel for Tensor.view(dtype) across element sizes (how `gguf`
    reads its blocks), its float8 support is recent and unverified here (`fp8`), and there is no Triton
    backend. The plain integer and float torch ops of `int8`, `awq` and `gptq` need nothing from the list."""

    @classmethod
    def availability(cls) -> Availability:
        if not _has_module("torch_xla"):
            return Availability.no("torch_xla is not installed (pip install 'torch_xla[tpu]')")
        if not _has_libtpu():
            return Availability.no(
                "torch_xla is installed but libtpu is not "
                "(pip install 'torch_xla[tpu]', or set TPU_LIBRARY_PATH)"
            )
        nodes = [path for pattern in DEVICE_NODE_PATTERNS for path in _glob(pattern)]
        if not nodes:
            return Availability.no("no TPU device nodes (/dev/accel* or /dev/vfio/N): this is not a TPU VM")
        listed = ", ".join(nodes)
        version = _dist_version("torch_xla")
        return Availability.yes(f"found {len(nodes)} TPU device node(s) ({listed}); torch_xla {version}")

    @classmethod
    def device_name(cls, index: int = 0) -> str:
        import torch_xla._internal.tpu as tpu

        return f"TPU v{tpu.version()}"

    @classmethod
    def device_count(cls) -> int:
        """Devices this host can address (tensor parallelism stays on one host)."""
        import torch_xla.runtime as xr

        return xr.addressable_runtime_device_count()

    @classmethod
    def total_memory(cls, index: int = 0) -> int:
        return _xla_memory(index)[1]

    @classmethod
    def free_memory(cls, index: int = 0) -> int:
        return _xla_memory(index)[0]

    @classmethod
    def synchronize(cls) -> None:
        import torch_xla.core.xla_model as xm

        xm.mark_step()
        xm.wait_device_ops()

    @classmethod
    def describe(cls) -> dict[str, str]:
        free, total = _xla_memory(0)
        return {
            "device": cls.device_name(),
            "device_count": str(cls.device_count()),
            "memory_total": gib(total),
            "memory_free": gib(free),
            "torch_xla": _dist_version("torch_xla"),
        }


@hookimpl
def pagellm_platforms() -> list[type[Platform]]:
    return [TpuPlatform]
