"""NVIDIA Nemotron-H (`NemotronHForCausalLM`: Nemotron-H-8B/47B/56B, NVIDIA-Nemotron-Nano-9B-v2): a stack of
blocks, each one RMSNorm, one mixer and the residual add, the mixer per block from `hybrid_override_pattern`
(transformers reads it as `layers_block_type`): a Mamba-2 layer ("M", linear_attention), attention ("*",
full_attention: no rotary, no biases, 1 / sqrt(head_dim) scale) or an MLP ("-": up_proj, squared ReLU,
down_proj, no gate). Nemotron 3's mixture-of-experts blocks ("E", non-gated experts) are refused.

The Mamba-2 layer is models/layers/mamba2.py's under Nemotron-H's config names (`mamba_num_heads`,
`mamba_head_dim`, `n_groups`, `ssm_state_size`, `conv_kernel`, `chunk_size`, `use_conv_bias`, `use_bias` for
the projections, `mamba_hidden_act`); transformers clamps dt at `time_step_min` from below (its
`time_step_limit` unused), and so does this. Attention layers are numbered among themselves for the KV cache
(`num_attention_layers`), Mamba layers likewise for their states. Checkpoints name the model `backbone`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from pagellm.core.errors import ConfigError
from pagellm.models.base import CausalLM, ModelInit
from pagellm.models.layers.activation import get_activation
from pagellm.models.layers.embedding import Embedding
from pagellm.models.layers.linear import Linear
from pagellm.models.layers.mamba2 import Mamba2Mixer, Mamba2Shape
from pagellm.models.layers.norm import RMSNorm
from pagellm.models.llama import STACKED, LlamaAttention, attention_spec
from pagellm.models.loader import copy_weights

QKV_STACKED = tuple(entry for entry in STACKED if entry[0] == "qkv_proj")
"""q/k/v into the fused qkv_proj; the MLP's `up_proj` stays itself (there is no gate to fuse it with)."""

MAMBA, ATTENTION, MLP = "linear_attention", "full_attention", "mlp"


MAMBA_FIELDS = (
    "mamba_num_heads mamba_head_dim n_groups ssm_state_size conv_kernel chunk_size use_conv_bias use_bias "
    "mamba_hidden_act layer_norm_epsilon"
)
"""Nemotron-H's names of `Mamba2Shape`'s fields (`use_bias`: the projections')."""


def nemotron_h_mamba_shape(c: Any) -> Mamba2Shape:
    return Mamba2Shape.from_config(c, MAMBA_FIELDS, (c.time_step_min, float("inf")))


class NemotronHAttention(LlamaAttention):
    o_bias = False


class NemotronHMLP(nn.Module):
    def __init__(self, init: ModelInit):
        super().__init__()
        c = init.hf_config
        self.up_proj = Linear(c.hidden_size, c.intermediate_size, c.mlp_bias, init.dtype, init.quant_method)
        self.act = get_activation(c.mlp_hidden_act)
        self.down_proj = Linear(c.intermediate_size, c.hidden_size, c.mlp_bias, init.dtype, init.quant_method)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.up_proj(h)))


class NemotronHBlock(nn.Module):
    def __init__(self, init: ModelInit, block_type: str, kind_idx: int):
        super().__init__()
        c = init.hf_config
        self.norm = RMSNorm(c.hidden_size, c.layer_norm_epsilon, init.dtype)
        self.is_attention = block_type == ATTENTION
        if block_type == MAMBA:
            self.mixer = Mamba2Mixer(init, kind_idx, nemotron_h_mamba_shape(c))
        elif self.is_attention:
            self.mixer = NemotronHAttention(init, kind_idx, False, False)
        else:
            self.mixer = NemotronHMLP(init)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        x = self.norm(h)
        return h + (self.mixer(x, None, None) if self.is_attention else self.mixer(x))


class NemotronHModel(nn.Module):
    def __init__(self, init: ModelInit):
        super().__init__()
        c = init.hf_config
        unsupported = sorted(set(c.layers_block_type) - {MAMBA, ATTENTION, MLP})
        if unsupported:
            raise ConfigError(
                f"Nemotron-H blocks of type {', '.join(unsupported)} are not supported (mixture-of-experts "
                "blocks, as in Nemotron 3, are not wired up); supported: Mamba-2, attention and MLP blocks"
            )
        self.embeddings = Embedding(c.vocab_size, c.hidden_size, init.dtype, init.parallel.tp)
        counts = dict.fromkeys((MAMBA, ATTENTION, MLP), 0)
        layers = []
        for block_type in c.layers_block_type:
            layers.append(NemotronHBlock(init, block_type, counts[block_type]))
            counts[block_type] += 1
        self.layers = nn.ModuleList(layers)
        self.norm_f = RMSNorm(c.hidden_size, c.layer_norm_epsilon, init.dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embeddings(input_ids)
        for layer in self.layers:
            h = layer(h)
        return self.norm_f(h)


class NemotronHForCausalLM(CausalLM):
    unsplit_layers = "the Mamba-2 mixers (models/layers/mamba2.py) have no split of their heads or state"
    """Module names are the checkpoint's (`backbone.`...); the output projection is never tied (transformers
    ties nothing for Nemotron-H)."""

    attention_spec = staticmethod(attention_spec)

    def __init__(self, init: ModelInit):
        super().__init__()
        c = init.hf_config
        self.backbone = NemotronHModel(init)
        self.lm_head = Linear(c.hidden_size, c.vocab_size, False, init.dtype)

    @staticmethod
    def num_attention_layers(hf_config: Any) -> int:
        return hf_config.layers_block_type.count(ATTENTION)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.backbone(input_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.project_logits(hidden, self.lm_head.weight)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return copy_weights(self, self._without_mtp(weights), QKV_STACKED)

    @staticmethod
    def _without_mtp(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Checkpoints with multi-token prediction layers (`mtp.*`) keep them beside the model; transformers
        skips them, and so does this."""
        return ((name, tensor) for name, tensor in weights if not name.startswith("mtp."))
