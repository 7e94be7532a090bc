"""StarCoder2 (`Starcoder2ForCausalLM`, BigCode's code models): Llama's skeleton (GQA, rotary, the tensor and
pipeline parallel split, the head) with GPT-2's kind of block inside, as transformers' `starcoder2` computes it:

- LayerNorm with a bias (`norm_epsilon`), not RMSNorm, before attention, before the MLP and at the end
- a plain MLP: `c_fc`, the activation (`hidden_act`, gelu with tanh as released), `c_proj`; no gate
- a bias on every projection (q/k/v/o, c_fc, c_proj) where `use_bias` (the released models)
- one sliding window (`sliding_window`) for every layer
- the output projection tied to the embedding where the config says so (its default)
"""

from __future__ import annotations

import torch
from torch import nn

from pagellm.models.base import ModelInit
from pagellm.models.layers.activation import get_activation
from pagellm.models.layers.linear import Linear, Shard
from pagellm.models.layers.norm import RMSNorm
from pagellm.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel, SpecFn


class Starcoder2LayerNorm(nn.LayerNorm):
    """torch's LayerNorm (weight and bias, in the model's dtype, as transformers runs it) with the residual
    add of the pre-norm pattern that LlamaModel's layers and its final norm call."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype):
        super().__init__(size, eps=eps, dtype=dtype)

    add_and_norm = RMSNorm.add_and_norm  # x + residual, then this norm's forward


class Starcoder2Attention(LlamaAttention):
    """Llama's attention with q/k/v/o biases from `use_bias` (LlamaForCausalLM and LlamaAttention read
    `attention_bias`, which StarCoder2's config does not have)."""

    def __init__(self, init: ModelInit, layer_idx: int, qkv_bias: bool, qk_norm: bool, spec_fn: SpecFn):
        c, tp = init.hf_config, init.parallel.tp
        super().__init__(init, layer_idx, bool(c.use_bias), qk_norm, spec_fn)
        if c.use_bias:
            self.o_proj = Linear(
                self.q_size,
                c.hidden_size,
                True,
                init.dtype,
                init.quant_method,
                shard=self.o_proj.shard,
                reduce=tp,
            )


class Starcoder2MLP(nn.Module):
    """c_fc column parallel, c_proj row parallel (its bias added once, after the ranks' sum)."""

    def __init__(self, init: ModelInit):
        super().__init__()
        c, tp = init.hf_config, init.parallel.tp
        size = c.intermediate_size // tp.size
        part = (tp.rank * size, size)
        split = tp.size > 1
        self.c_fc = Linear(
            c.hidden_size,
            size,
            c.use_bias,
            init.dtype,
            init.quant_method,
            shard=Shard(0, (part,)) if split else None,
        )
        self.act = get_activation(c.hidden_act)
        self.c_proj = Linear(
            size,
            c.hidden_size,
            c.use_bias,
            init.dtype,
            init.quant_method,
            shard=Shard(1, (part,)) if split else None,
            reduce=tp,
        )

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(h)))


class Starcoder2DecoderLayer(LlamaDecoderLayer):
    """Llama's pre-norm layer with LayerNorms and StarCoder2's attention and MLP."""

    attention_class = Starcoder2Attention

    def __init__(self, init: ModelInit, layer_idx: int, qkv_bias: bool, qk_norm: bool, spec_fn: SpecFn):
        nn.Module.__init__(self)
        c = init.hf_config
        self.input_layernorm = Starcoder2LayerNorm(c.hidden_size, c.norm_epsilon, init.dtype)
        self.self_attn = self.build_attention(init, layer_idx, qkv_bias, qk_norm, spec_fn)
        self.post_attention_layernorm = Starcoder2LayerNorm(c.hidden_size, c.norm_epsilon, init.dtype)
        self.mlp = Starcoder2MLP(init)


class Starcoder2Model(LlamaModel):
    layer_class = Starcoder2DecoderLayer
    norm_class = Starcoder2LayerNorm
    eps_field = "norm_epsilon"


class Starcoder2ForCausalLM(LlamaForCausalLM):
    """Tied by default, as transformers' config is."""

    tied_by_default = True
    model_class = Starcoder2Model
