"""EXAONE 4.0 (`Exaone4ForCausalLM`, LG AI Research), as transformers' `exaone4` computes it: OLMo 2's block
(no norms before attention or the MLP; each block's output normalised before it joins the residual stream)
with

- per-head q/k RMSNorm before the rotary (Qwen3's, not OLMo 2's norm over the whole projection)
- RMSNorms that scale by the weight after the cast back to the input dtype (Llama's, not OLMo 2's)
- hybrid attention where the config has a `sliding_window`: the layers `layer_types` marks sliding (three
  of every four in the 32B model, `sliding_window_pattern`) attend within the window and rotate q and k;
  the full-attention layers rotate nothing (NoPE). Without a window (the 1.2B model) every layer is full
  and rotates.

The sliding layers' KV blocks are freed as the window moves (KV cache groups), as for Gemma 3.
"""

from __future__ import annotations

from typing import Any

from pagellm.core.errors import ConfigError
from pagellm.models.base import ModelInit
from pagellm.models.layers.norm import RMSNorm
from pagellm.models.llama import LlamaAttention, LlamaForCausalLM, SpecFn
from pagellm.models.olmo2 import Olmo2DecoderLayer, Olmo2Model
from pagellm.models.smollm3 import NoPEWhereOff


def uses_rope(hf_config: Any, layer_idx: int) -> bool:
    """transformers rotates where the config has no window, or on the sliding layers; never on the full
    layers of a hybrid model."""
    return hf_config.sliding_window is None or hf_config.layer_types[layer_idx] == "sliding_attention"


class Exaone4DecoderLayer(NoPEWhereOff, Olmo2DecoderLayer):
    attention_class = LlamaAttention
    norm_class = RMSNorm

    def __init__(self, init: ModelInit, layer_idx: int, qkv_bias: bool, qk_norm: bool, spec_fn: SpecFn):
        super().__init__(init, layer_idx, qkv_bias, qk_norm, spec_fn)
        self.use_rope = uses_rope(init.hf_config, layer_idx)


class Exaone4Model(Olmo2Model):
    layer_class = Exaone4DecoderLayer
    norm_class = RMSNorm


class Exaone4ForCausalLM(LlamaForCausalLM):
    """Per-head q/k norms (`qk_norm`); the windows come from Llama's `attention_spec`, which reads
    `layer_types` and `sliding_window`."""

    qk_norm = True
    model_class = Exaone4Model

    def __init__(self, init: ModelInit):
        c = init.hf_config
        if c.sliding_window is None and "sliding_attention" in c.layer_types:
            raise ConfigError(
                "EXAONE 4: layer_types marks sliding-window layers but the config has no sliding_window "
                "(transformers cannot run such a config either)"
            )
        super().__init__(init)
