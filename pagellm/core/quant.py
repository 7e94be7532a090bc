"""The `QuantMethod` interface: one weight format (fp8, int8, AWQ, GPTQ, GGUF, or a vendor's).

A model's linear layers call `create_weights` at construction, the loader fills the parameters it made,
`process_weights_after_loading` repacks them once, and `apply` is the layer's forward.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import torch

if TYPE_CHECKING:
    from pagellm.core.platform import Platform


class QuantMethod:
    name: ClassVar[str]
    """What users pass to `--quantization` and what checkpoints name in `quantization_config.quant_method`."""
    platforms: ClassVar[tuple[str, ...] | None] = None
    """Platform names it runs on; None: any."""
    min_capability: ClassVar[tuple[int, int] | None] = None
    """Lowest device capability (platforms that report one), e.g. (8, 9) for FP8 matmul."""
    loads_gguf_blocks: ClassVar[bool] = False
    """True: from a GGUF checkpoint, the engine hands `create_weights`' parameters the file's packed blocks,
    read straight from the .gguf file (`<layer>.qweight`: uint8 [rows, bytes per row], `<layer>.qweight_type`:
    the GGML type number). False: the float weights of the Hugging Face copy the file is converted to."""

    @classmethod
    def matches_checkpoint(cls, quantization_config: dict[str, Any]) -> bool:
        """True when a checkpoint's `quantization_config` is in this format."""
        return quantization_config.get("quant_method") == cls.name

    @classmethod
    def unsupported_reasons(cls, platform: type[Platform]) -> list[str]:
        reasons = []
        if cls.platforms is not None and platform.name not in cls.platforms:
            reasons.append(f"runs on {', '.join(cls.platforms)}, not {platform.name}")
        if not platform.supports_quantization(cls.name):
            reasons.append(f"platform {platform.name} does not list {cls.name}")
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

    def create_weights(
        self, layer: torch.nn.Module, in_features: int, out_features: int, params_dtype: torch.dtype
    ) -> None:
        """Register the layer's weight parameters in this format on `layer`."""
        raise NotImplementedError

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Repack loaded weights for `apply` (optional)."""

    def apply(
        self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """y = x @ W^T + bias with this format's weights."""
        raise NotImplementedError
