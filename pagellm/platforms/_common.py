"""What the built-in platforms share: machine-dependent facts, the GPU-style torch runtime queries, and
the config checks every accelerator makes."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from pagellm.core.dtypes import DTYPES, dtype_name
from pagellm.core.errors import ConfigError
from pagellm.core.platform import TRITON, GiB, Platform
from pagellm.core.state import RecurrentKernels
from pagellm.platforms.triton_moe import pack_triton_moe, triton_moe_runs
from pagellm.platforms.triton_recurrent import TRITON_RECURRENT_KERNELS

if TYPE_CHECKING:
    from pagellm.core.config import EngineConfig
    from pagellm.core.moe import PackedMoE


class classproperty:
    """A read-only class attribute computed on each access, for facts that depend on the machine
    (a CPU's ISA, a GPU's compute capability) but that callers read like the plain `Platform` facts."""

    def __init__(self, fget: Callable[[Any], Any]):
        self.fget = fget
        self.__doc__ = fget.__doc__

    def __get__(self, obj: Any, owner: type) -> Any:
        return self.fget(owner)


def triton_capability() -> frozenset[str]:
    """`triton` where the triton package is installed, for a device family with a Triton backend (CUDA,
    ROCm, XPU); found without importing it."""
    return frozenset({TRITON}) if importlib.util.find_spec("triton") is not None else frozenset()


def hidden_by(variables: tuple[str, ...]) -> str | None:
    """Which device-mask environment variable is set, as a reason, if any (the first one set)."""
    for name in variables:
        value = os.environ.get(name)
        if value is not None:
            return f"{name} is empty" if not value.strip() else f"{name}={value!r}"
    return None


def gib(n: int) -> str:
    return f"{n / GiB:.1f} GiB"


def check_memory_utilization(config: EngineConfig) -> None:
    if not 0 < config.gpu_memory_utilization <= 1:
        raise ConfigError(
            f"gpu_memory_utilization must be in (0, 1], got {config.gpu_memory_utilization}; "
            f"pass --gpu-memory-utilization 0.9 (the fraction of device memory pagellm may use)"
        )


def check_dtype(platform: type[Platform], config: EngineConfig) -> None:
    """Refuse an explicit --dtype the device cannot compute in (`auto` is resolved elsewhere)."""
    if config.dtype == "auto":
        return
    if DTYPES[config.dtype] in platform.supported_dtypes:
        return
    capability = platform.device_capability()
    device = platform.device_name()
    if capability is not None:
        device += f" (compute capability {capability[0]}.{capability[1]})"
    supported = ", ".join(dtype_name(d) for d in platform.supported_dtypes)
    raise ConfigError(
        f"dtype {config.dtype} is not supported by {device}; supported here: {supported}. "
        f"Use --dtype {dtype_name(platform.default_dtype)}."
    )


def check_tensor_parallel(platform: type[Platform], config: EngineConfig) -> None:
    """Tensor parallelism stays on one host: refused up front rather than as a bad device ordinal later."""
    count = platform.device_count()
    if config.tensor_parallel_size > count:
        raise ConfigError(
            f"tensor_parallel_size {config.tensor_parallel_size} is more than the {count} {platform.name} "
            f"device(s) visible here; pass --tensor-parallel-size {count} or less"
        )
    ranks = config.tensor_parallel_size * config.pipeline_parallel_size
    if ranks > count and config.distributed_executor_backend != "ray":
        raise ConfigError(
            f"tensor_parallel_size {config.tensor_parallel_size} x pipeline_parallel_size "
            f"{config.pipeline_parallel_size} needs {ranks} {platform.name} devices, {count} are visible here"
        )


class AcceleratorPlatform(Platform):
    """The config checks every accelerator makes (CUDA, ROCm, XPU, TPU); not registered itself."""

    @classmethod
    def check_and_update_config(cls, config: EngineConfig) -> None:
        check_memory_utilization(config)
        check_dtype(cls, config)
        check_tensor_parallel(cls, config)


class TorchRuntimePlatform(AcceleratorPlatform):
    """Device queries through a torch runtime module with the `torch.cuda` API (torch.cuda, torch.xpu).

    Not registered itself: CUDA, ROCm and XPU subclass it and add their facts and `availability()`.
    """

    runtime: ClassVar[str]
    """Attribute of `torch` that drives the device: `cuda` (also for ROCm) or `xpu`."""

    @classmethod
    def _runtime(cls) -> Any:
        return getattr(torch, cls.runtime)

    @classmethod
    def device_name(cls, index: int = 0) -> str:
        return cls._runtime().get_device_name(index)

    @classmethod
    def device_count(cls) -> int:
        return cls._runtime().device_count()

    @classmethod
    def total_memory(cls, index: int = 0) -> int:
        return cls._runtime().get_device_properties(index).total_memory

    @classmethod
    def free_memory(cls, index: int = 0) -> int:
        return cls._runtime().mem_get_info(index)[0]

    @classmethod
    def reset_peak_memory(cls, index: int = 0) -> None:
        cls._runtime().reset_peak_memory_stats(index)

    @classmethod
    def peak_memory_allocated(cls, index: int = 0) -> int:
        return cls._runtime().max_memory_allocated(index)

    @classmethod
    def non_torch_memory(cls, index: int = 0) -> int:
        """In use on the device (total less free) less what torch's caching allocator reserved."""
        runtime = cls._runtime()
        free, total = runtime.mem_get_info(index)
        return max(total - free - runtime.memory_reserved(index), 0)

    @classmethod
    def synchronize(cls) -> None:
        cls._runtime().synchronize()

    @classmethod
    def supports_cuda_graphs(cls) -> bool:
        """CUDA and ROCm builds capture through torch.cuda.graph; XPU has no such API there."""
        return cls.runtime == "cuda"

    @classmethod
    def pack_moe(
        cls,
        w13: torch.Tensor,
        w2: torch.Tensor,
        w13_bias: torch.Tensor | None,
        w2_bias: torch.Tensor | None,
        activation: str,
        w13_scale: torch.Tensor | None = None,
        w2_scale: torch.Tensor | None = None,
    ) -> PackedMoE | None:
        """The Triton fused-MoE kernel (`triton_moe`) on CUDA and ROCm where triton is installed and the
        weights are in a float dtype it runs; None elsewhere (XPU: untried; quantized experts: the kernel
        reads no scales), so the reference runs."""
        if cls.runtime != "cuda" or TRITON not in cls.capabilities or not triton_moe_runs(w13):
            return None
        return pack_triton_moe(w13, w2, w13_bias, w2_bias, activation)

    @classmethod
    def recurrent_kernels(cls) -> RecurrentKernels:
        """The Triton conv, delta-rule and SSM kernels (`triton_recurrent`) on CUDA and ROCm where triton is
        installed; the plain-torch references elsewhere (XPU: untried)."""
        if cls.runtime != "cuda" or TRITON not in cls.capabilities:
            return RecurrentKernels()
        return TRITON_RECURRENT_KERNELS

    @classmethod
    def describe(cls) -> dict[str, str]:
        facts = {"device": cls.device_name(), "device_count": str(cls.device_count())}
        capability = cls.device_capability()
        if capability is not None:
            facts["capability"] = f"{capability[0]}.{capability[1]}"
        free, total = cls._runtime().mem_get_info(0)
        facts["memory_total"] = gib(total)
        facts["memory_free"] = gib(free)
        facts["default_dtype"] = dtype_name(cls.default_dtype)
        return facts
