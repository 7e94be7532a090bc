"""Phi-3 and Phi-4-mini (`Phi3ForCausalLM`): the Llama decoder with q/k/v and gate/up already fused in the
checkpoint, LongRoPE (short/long factors, models/layers/rotary.py), partial rotary (Phi-4-mini rotates
3/4 of each head) and an optional sliding window on every layer.

The fused checkpoint tensors are split into their q/k/v (gate/up) rows at load and loaded like Llama's
separate ones, so a tensor-parallel rank takes its heads (and MLP columns) of each part, reading only
those rows of a safetensors file. A GGUF file's packed blocks (`--quantization gguf`) split the same way:
each row of a GGUF tensor is one output, its blocks running along the input.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from pagellm.core.errors import ConfigError
from pagellm.models.base import ModelInit, head_size
from pagellm.models.llama import STACKED, LlamaForCausalLM
from pagellm.models.loader import CheckpointSlice, copy_weights


class Phi3ForCausalLM(LlamaForCausalLM):
    family = "Phi-3"
    """The family named where a pre-quantized checkpoint is refused (GLM-4 reuses this loader)."""

    def __init__(self, init: ModelInit):
        super().__init__(init)
        c = init.hf_config
        self.gguf_rows = init.quant_method is not None and init.quant_method.loads_gguf_blocks
        q, kv = c.num_attention_heads * head_size(c), c.num_key_value_heads * head_size(c)
        self.fused_parts = {
            ".qkv_proj.": (("q_proj", q), ("k_proj", kv), ("v_proj", kv)),
            ".gate_up_proj.": (("gate_proj", c.intermediate_size), ("up_proj", c.intermediate_size)),
        }

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return copy_weights(self, self._split_fused(weights), STACKED, self._adapt)

    def _split_fused(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Checkpoint `qkv_proj` as q_proj, k_proj, v_proj and `gate_up_proj` as gate_proj, up_proj: row
        ranges of the output dimension, in that order (GGUF's packed rows too, each part with the fused
        tensor's type)."""
        for name, tensor in weights:
            fused = next((key for key in self.fused_parts if key in name), None)
            if fused is None:
                yield name, tensor
                continue
            if not self._on_this_stage(name):
                continue
            if self.gguf_rows and name.endswith(".qweight_type"):  # one GGML type for every part
                for part, _ in self.fused_parts[fused]:
                    yield name.replace(fused, f".{part}."), tensor
                continue
            if not name.endswith((".weight", ".bias")) and not (self.gguf_rows and name.endswith(".qweight")):
                raise ConfigError(
                    f"checkpoint tensor {name!r}: pre-quantized {self.family} checkpoints (fused, packed "
                    f"tensors) are not supported; use an unquantized checkpoint (--quantization quantizes it "
                    f"at load)"
                )
            start = 0
            for part, size in self.fused_parts[fused]:
                rows = (
                    _Rows(tensor, start, size)
                    if isinstance(tensor, CheckpointSlice)
                    else tensor.narrow(0, start, size)
                )
                yield name.replace(fused, f".{part}."), rows
                start += size


class _Rows(CheckpointSlice):
    """Rows start .. start + size of a safetensors tensor not read yet; reads only what is asked for."""

    def __init__(self, whole: CheckpointSlice, start: int, size: int):
        self._whole, self._start = whole, start
        self.shape = torch.Size([size, *whole.shape[1:]])

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        if dim == 0:
            return self._whole.narrow(0, self._start + start, length)
        return self.load().narrow(dim, start, length)

    def load(self) -> torch.Tensor:
        return self._whole.narrow(0, self._start, self.shape[0])
