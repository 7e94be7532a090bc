"""Multi-token prediction with the layer Qwen3-Next and Qwen3.5 checkpoints ship beside the model (`mtp.*`,
`mtp_num_hidden_layers`; transformers leaves it unread).

The layer (vLLM's `qwen3_next_mtp.py` and `qwen3_5_mtp.py`): the next token's embedding and the target's
final (normed) hidden state, each normed ((1 + w) RMSNorms `pre_fc_norm_embedding`, `pre_fc_norm_hidden`),
concatenated and projected (`fc`), then one decoder layer of the family with gated full attention (and the
family's experts where the model has them), then `norm`. That normed output is both the next step's hidden
state and, through the target's lm_head, the draft's logits. Drafting reuses the layer k times through the
proposer EAGLE-3 heads and DeepSeek's MTP layer use (`head_proposer.py`); the target speculates on its
delta nets as every method does (their states put back after a rejection: models/context.DraftReplay).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagellm.core.errors import ConfigError
from pagellm.models.layers.fused_moe.loading import copy_weights_with_experts
from pagellm.models.layers.gated_delta_net import GatedDeltaNet
from pagellm.models.layers.linear import Linear
from pagellm.models.layers.norm import GemmaRMSNorm
from pagellm.models.llama import STACKED
from pagellm.models.loader import CheckpointSlice, iter_checkpoint_weights
from pagellm.models.qwen3_next import FULL_ATTENTION, Qwen3NextDecoderLayer, Qwen3NextForCausalLM

QWEN_MTP_MODEL_TYPES = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")


class QwenMTPHead(nn.Module):
    """The checkpoint's MTP layer under the head's names (`fc`, the norms, `layer`: `mtp.layers.0`)."""

    def __init__(self, init: Any, target: Qwen3NextForCausalLM):
        super().__init__()
        c = init.hf_config
        eps, dtype = c.rms_norm_eps, init.dtype
        self.pre_fc_norm_embedding = GemmaRMSNorm(c.hidden_size, eps, dtype)
        self.pre_fc_norm_hidden = GemmaRMSNorm(c.hidden_size, eps, dtype)
        self.fc = Linear(2 * c.hidden_size, c.hidden_size, False, dtype)
        # attention layer 0 of the head's own KV cache; experts as the target's layers route them
        self.layer = Qwen3NextDecoderLayer(
            init, c.num_hidden_layers, FULL_ATTENTION, 0, target.grouped_projections, target.routing
        )
        self.norm = GemmaRMSNorm(c.hidden_size, eps, dtype)
        self.rotary = target.model.rotary_emb  # the target's (shared, not the head's module)
        self.embed_tokens = target.model.embed_tokens
        self.target_logits = target.compute_logits

    def attention_layers(self) -> list[nn.Module]:
        return [self.layer.self_attn.attn]

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(normed output, the next step's hidden state): the same tensor, as this layer chains its normed
        output."""
        embeds = self.pre_fc_norm_embedding(self.embed_tokens(input_ids))
        x = self.fc(torch.cat([embeds, self.pre_fc_norm_hidden(hidden)], dim=-1))
        cos, sin = self.rotary.cos_sin(positions)
        out = self.norm(self.layer(x, cos, sin))
        return out, out

    def greedy_tokens(self, normed: torch.Tensor) -> torch.Tensor:
        return self.target_logits(normed).float().argmax(dim=-1)


def load_qwen_mtp(setup: Any, target: nn.Module, init: Any, device: torch.device) -> QwenMTPHead:
    """The MTP layer of a Qwen3-Next or Qwen3.5 checkpoint on `device` (the checkpoint read a second time,
    only its `mtp.*` tensors); a ConfigError where it has none or more than one."""
    layers = getattr(setup.hf_config, "mtp_num_hidden_layers", 1)
    if layers != 1:
        raise ConfigError(f"speculative_config: mtp runs one MTP layer; the checkpoint has {layers}")
    tensors = [
        (_head_name(n), t.load() if isinstance(t, CheckpointSlice) else t)
        for n, t in iter_checkpoint_weights(setup.source.directory, lazy=True)
        if n.startswith("mtp.")
    ]
    if not tensors:
        raise ConfigError("speculative_config: the checkpoint has no MTP layers (no mtp.* tensors)")
    with torch.device(device):
        head = QwenMTPHead(init, target)
    loaded = copy_weights_with_experts(head, tensors, (*STACKED, *GatedDeltaNet.STACKED))
    shared = ("embed_tokens.", "rotary.")  # the target's
    missing = sorted(n for n, _ in head.named_parameters() if n not in loaded and not n.startswith(shared))
    if missing:
        raise ConfigError(f"speculative_config: the checkpoint's MTP layer lacks {', '.join(missing[:6])}")
    return head.eval().requires_grad_(False)


def _head_name(name: str) -> str:
    """A checkpoint's `mtp.*` name as the head's: `mtp.layers.0.` is `layer.`."""
    return name.removeprefix("mtp.").replace("layers.0.", "layer.", 1)
