"""The `QuantMethod` interface: one weight format (fp8, int8, AWQ, GPTQ, GGUF, or a vendor's).

A model's linear layers call `create_weights` at construction, the loader fills the parameters it made
from the checkpoint's tensors (as `checkpoint_weights` hands them on), `process_weights_after_loading`
repacks them once, and `apply` is the layer's forward.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from pagellm.core.dtypes import dtype_name
from pagellm.core.moe import PackedMoE
from pagellm.core.platform import CAPABILITIES

if TYPE_CHECKING:
    from pagellm.core.platform import Platform


class QuantMethod:
    """One weight format. The class facts say what it needs of a platform, as an attention backend's do;
    the selector refuses it, with every reason, where a need is unmet, and accepts it everywhere else (a new
    method needs no change to any platform)."""

    name: ClassVar[str]
    """What users pass to `--quantization` and what checkpoints name in `quantization_config.quant_method`."""
    device_types: ClassVar[tuple[str, ...] | None] = None
    """torch device types it runs on (`Platform.device_type`: cpu, cuda, xpu, xla, ...); None: any."""
    platforms: ClassVar[tuple[str, ...] | None] = None
    """Platform names it runs on (for a method tied to one vendor's device); None: any."""
    requires: ClassVar[tuple[str, ...]] = ()
    """Capabilities the platform must declare in `Platform.capabilities`: pagellm's names are in
    `core.platform.CAPABILITIES` (`float8`, `dtype_views`, `triton`, `fp8_matmul`), a vendor may add its own.
    Only what it cannot run without: a fast path it probes for and falls back from is no need."""
    dtypes: ClassVar[tuple[torch.dtype, ...] | None] = None
    """Activation (compute) dtypes `apply` takes; None: any. The platform must support one of them, and the
    model's dtype must be one where the selector is given it (`select_quant_method(..., dtype=)`)."""
    min_capability: ClassVar[tuple[int, int] | None] = None
    """Lowest device capability (platforms that report one), e.g. (8, 9) for FP8 matmul."""
    expert_dtype: ClassVar[torch.dtype | None] = None
    """The dtype a mixture-of-experts layer (`FusedMoE`) keeps its routed experts in under this method,
    one of `core.moe.QUANTIZED_DTYPES`, with a float32 scale per output row (`quantize_rows`); experts
    are weight-only whatever the method does for linears. None: the experts stay in the model's dtype."""
    loads_gguf_blocks: ClassVar[bool] = False
    """True: from a GGUF checkpoint, the engine hands `create_weights`' parameters the file's packed blocks,
    read straight from the .gguf file (`<layer>.qweight`: uint8 [rows, bytes per row], `<layer>.qweight_type`:
    the GGML type number). False: the float weights of the Hugging Face copy the file is converted to."""

    @classmethod
    def matches_checkpoint(cls, quantization_config: dict[str, Any]) -> bool:
        """True when a checkpoint's `quantization_config` is in this format."""
        return quantization_config.get("quant_method") == cls.name

    @classmethod
    def unsupported_reasons(cls, platform: type[Platform], dtype: torch.dtype | None = None) -> list[str]:
        """Every reason this method cannot run on `platform` (in `dtype`, when given); empty: it can.

        The default checks the class facts; override to add more (a missing package), calling super()."""
        reasons = []
        if cls.platforms is not None and platform.name not in cls.platforms:
            reasons.append(f"runs on {', '.join(cls.platforms)}, not {platform.name}")
        if cls.device_types is not None and platform.device_type not in cls.device_types:
            reasons.append(f"runs on device types {', '.join(cls.device_types)}, not {platform.device_type}")
        for need in (n for n in cls.requires if n not in platform.capabilities):
            what = f" ({CAPABILITIES[need]})" if need in CAPABILITIES else ""
            reasons.append(f"needs {need}{what}, which platform {platform.name} does not declare")
        if cls.dtypes is not None:
            names = ", ".join(map(dtype_name, cls.dtypes))
            if not any(d in cls.dtypes for d in platform.supported_dtypes):
                supported = ", ".join(map(dtype_name, platform.supported_dtypes))
                reasons.append(f"computes in {names}; {platform.name} supports {supported}")
            elif dtype is not None and dtype not in cls.dtypes:
                reasons.append(f"dtype {dtype_name(dtype)} not in {names}")
        if cls.min_capability is not None and platform.availability().ok:
            capability = platform.device_capability()
            if capability is not None and capability < cls.min_capability:
                need = ".".join(map(str, cls.min_capability))
                reasons.append(
                    f"needs device capability >= {need}, this device has {capability[0]}.{capability[1]}"
                )
        return reasons

    def __init__(self, quantization_config: dict[str, Any] | None = None):
        self.quantization_config = quantization_config or {}

    @classmethod
    def quantize_rows(cls, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Symmetric per-row quantization for `expert_dtype`: weight [..., rows, cols] -> (values in
        `expert_dtype`, float32 scales [..., rows])."""
        raise NotImplementedError

    def prepare_model(self, model: torch.nn.Module) -> None:
        """The model, built and not loaded yet, before its weights stream through `checkpoint_weights`
        (optional): the `gguf` method packs token tables into it as their blocks come, and drops their
        float weights from the stream."""

    def checkpoint_weights(
        self, weights: Iterable[tuple[str, Any]], float_modules: tuple[str, ...] = ()
    ) -> Iterable[tuple[str, Any]]:
        """The checkpoint's (name, tensor) stream as the model's layers read it under this method; the default
        passes it through. A method whose checkpoints hold a layout the layers do not read translates it here
        (block-wise fp8: per-row scales). `float_modules`: checkpoint modules (last name part) the model reads
        as plain float weights whatever the checkpoint holds (`CausalLM.float_modules`)."""
        return weights

    def create_weights(
        self, layer: torch.nn.Module, in_features: int, out_features: int, params_dtype: torch.dtype
    ) -> None:
        """Register the layer's weight parameters in this format on `layer`."""
        raise NotImplementedError

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Repack loaded weights for `apply` (optional)."""

    def process_model_after_loading(self, model: torch.nn.Module) -> None:
        """Repack what is not a quantized linear layer once the whole model is loaded (optional): the `gguf`
        method keeps a token embedding and output projection stored in blocks packed."""

    def apply(
        self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """y = x @ W^T + bias with this format's weights."""
        raise NotImplementedError

    def native_blocks(self, layer: torch.nn.Module) -> list[tuple[torch.Tensor, int]] | None:
        """The layer's weight as a platform's native kernels read it in place, or None (optional): the
        `gguf` method's parts in GGML block types, each uint8 [rows, bytes] with its type id, rows in
        output order. A native decode step (`core/native_decode.py`) multiplies such a layer itself."""
        return None

    def take_up_kernels(self, model: torch.nn.Module) -> None:
        """The platform's kernels, built in the background while the engine served, are here (called by the
        model runner between two steps): put back on them what was loaded another way meanwhile
        (optional; the `gguf` method widened the blocks they read)."""

    def pack_gguf_experts(
        self, blocks: dict[str, tuple[torch.Tensor, int]], activation: str, device: torch.device
    ) -> PackedMoE | None:
        """For a method that `loads_gguf_blocks`: a mixture-of-experts layer's stacked experts as the file
        holds them (`blocks`: "gate_proj", "up_proj", "down_proj" -> (uint8 [E, rows, bytes per row], GGML
        type)) on a kernel that reads them in place on `device`, or None: the layer then takes each expert
        from `dequantize_gguf` and runs it as float experts."""
        return None

    def waits_for_kernels(self, device: torch.device) -> bool:
        """For a method that `loads_gguf_blocks`: whether the kernel that reads blocks on `device` is still
        being built. A mixture-of-experts layer then runs its experts widened (`dequantize_gguf`) and keeps
        the blocks aside for `pack_gguf_experts` once the model runner takes the kernels up."""
        return False

    def dequantize_gguf(self, raw: torch.Tensor, type_id: int, dtype: torch.dtype) -> torch.Tensor:
        """For a method that `loads_gguf_blocks`: uint8 [rows, bytes per row] of GGML type `type_id` as
        [rows, columns] in `dtype`, for what it does not keep packed."""
        raise NotImplementedError
