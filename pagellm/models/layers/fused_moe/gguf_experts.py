"""A GGUF file's stacked expert tensors as they reach a `FusedMoE` layer under a method that
`loads_gguf_blocks` (`--quantization gguf`): per projection, `experts.<projection>.qweight` (the file's
bytes, uint8 [E, rows, bytes per row]) and `.qweight_type` (its GGML type), gathered until all three
projections are here, when the layer decides whether they stay blocks (`FusedMoE._load_gguf_blocks`)."""

from __future__ import annotations

import torch

from pagellm.core.errors import ConfigError

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
"""The stacked tensors' per-expert module names (`ffn_gate_exps`, `ffn_up_exps`, `ffn_down_exps`)."""


class GgufExpertBlocks:
    """One layer's stacked expert tensors, gathered as they arrive."""

    def __init__(self):
        self._parts: dict[str, dict[str, torch.Tensor]] = {}

    def add(self, name: str, tensor: torch.Tensor) -> bool:
        """Keep `<projection>.qweight` or `<projection>.qweight_type`; True once every projection has both."""
        module, _, kind = name.partition(".")
        if module not in PROJECTIONS or kind not in ("qweight", "qweight_type"):
            raise ConfigError(f"checkpoint tensor experts.{name} has no counterpart in FusedMoE")
        self._parts.setdefault(module, {})[kind] = tensor
        return all(len(self._parts.get(m, ())) == 2 for m in PROJECTIONS)

    @property
    def blocks(self) -> dict[str, tuple[torch.Tensor, int]]:
        """projection -> (uint8 [E, rows, bytes per row], GGML type)."""
        return {m: (self._parts[m]["qweight"], int(self._parts[m]["qweight_type"])) for m in PROJECTIONS}
