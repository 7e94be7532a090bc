"""Multi-token prediction (MTP) drafting with the layer DeepSeek-V3 and GLM-4.5 checkpoints ship after
their decoder layers (`model.layers.<num_hidden_layers>.*`, `num_nextn_predict_layers`); Qwen3-Next's and
Qwen3.5's (`mtp.*`) in `qwen_mtp.py`; Gemma 4's, a checkpoint of its own (the assistant), in
`gemma4_assistant.py`.

The MTP layer (vLLM's `deepseek_mtp.py`): the next token's embedding and the target's final hidden state,
each RMS-normed (`enorm`, `hnorm`), concatenated and projected (`eh_proj`), then one decoder layer of the
family (the layer the family would build at that index: MLA and experts for DeepSeek-V3), whose output
(the residual stream) is the next step's hidden state and, normed by `shared_head.norm`, gives logits
through `shared_head.head`. Drafting reuses the one layer k times, as vLLM does, through the proposer
EAGLE-3 heads use (`head_proposer.py`); the hidden state it reads is the target's final (normed) one.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import nn

from pagellm.core.errors import ConfigError
from pagellm.models.deepseek import adapt_moe_names
from pagellm.models.gemma4 import Gemma4ForCausalLM, Gemma4Model
from pagellm.models.layers.linear import Linear
from pagellm.models.layers.norm import RMSNorm
from pagellm.models.loader import CheckpointSlice, iter_checkpoint_weights
from pagellm.models.qwen3_next import Qwen3NextForCausalLM
from pagellm.spec_decode.gemma4_assistant import Gemma4AssistantHead, load_gemma4_assistant
from pagellm.spec_decode.head_proposer import ChainedHeadProposer
from pagellm.spec_decode.qwen_mtp import QWEN_MTP_MODEL_TYPES, QwenMTPHead, load_qwen_mtp
from pagellm.spec_decode.shared_kv_proposer import SharedKVHeadProposer

MTP_MODEL_TYPES = ("deepseek_v3", "glm4_moe")


class MTPHead(nn.Module):
    """The checkpoint's first MTP layer under its own names (`model.layers.<N>.*`): the family's decoder
    layer at index N with `enorm`, `hnorm`, `eh_proj` and `shared_head` added to it."""

    def __init__(self, init: Any, target: nn.Module):
        super().__init__()
        c = init.hf_config
        self.index = c.num_hidden_layers
        qkv_bias = target.qkv_bias if target.qkv_bias is not None else getattr(c, "attention_bias", False)
        layer = target.model.layer_class(init, self.index, qkv_bias, target.qk_norm, target.attention_spec)
        layer.enorm = RMSNorm(c.hidden_size, c.rms_norm_eps, init.dtype)
        layer.hnorm = RMSNorm(c.hidden_size, c.rms_norm_eps, init.dtype)
        layer.eh_proj = Linear(2 * c.hidden_size, c.hidden_size, False, init.dtype)
        layer.shared_head = nn.Module()
        layer.shared_head.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, init.dtype)
        layer.shared_head.head = Linear(c.hidden_size, c.vocab_size, False, init.dtype)
        self.model = nn.Module()
        self.model.layers = nn.ModuleDict({str(self.index): layer})
        self.layer = layer
        self.rope = target.model.rope  # the target's rotary embedding (a method: not the head's module)
        self.embed_tokens: nn.Module = target.model.embed_tokens

    def attention_layers(self) -> list[nn.Module | None]:
        """By layer_idx: the MTP layer's attention at index N, nothing before it."""
        return [None] * self.index + [self.layer.self_attn.attn]

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(normed output, output before the norm); position 0's embedding is zero (nothing precedes it)."""
        embeds = self.embed_tokens(input_ids).masked_fill((positions == 0).unsqueeze(-1), 0)
        x = self.layer.eh_proj(torch.cat([self.layer.enorm(embeds), self.layer.hnorm(hidden)], dim=-1))
        cos, sin = self.rope(positions)[0]
        h, residual = self.layer(x, None, cos, sin)
        out = h + residual
        return self.layer.shared_head.norm(out), out

    def _adapt(self, name: str, tensor: Any) -> tuple[str, Any] | None:
        """For the family's `load_weights`: the layer's tensors under its names, read now; its
        `embed_tokens` is the target's (the same table in the released checkpoints), not read again."""
        if name == f"model.layers.{self.index}.embed_tokens.weight":
            return None
        return adapt_moe_names(name), tensor.load() if isinstance(tensor, CheckpointSlice) else tensor

    def greedy_tokens(self, normed: torch.Tensor) -> torch.Tensor:
        return self.layer.shared_head.head(normed).float().argmax(dim=-1)


def load_mtp(
    setup: Any, target: nn.Module, init: Any, device: torch.device
) -> MTPHead | QwenMTPHead | Gemma4AssistantHead:
    """The MTP layer of the target's checkpoint on `device` (read a second time, only that layer's
    tensors; Qwen3-Next's and Qwen3.5's: `qwen_mtp.py`), or for Gemma 4 the assistant checkpoint
    `speculative_config.model` names (`gemma4_assistant.py`); a ConfigError where there is none or it
    cannot run here."""
    c = setup.hf_config
    model_type = getattr(c, "model_type", None)
    assistant = setup.config.speculative.model
    gemma4 = isinstance(target, Gemma4ForCausalLM)
    if gemma4 != bool(assistant):
        raise ConfigError(
            "speculative_config.model: Gemma 4 ships its MTP drafter as a checkpoint of its own (the "
            "`*-assistant` beside each model): name its directory"
            if gemma4
            else "speculative_config.model: mtp takes a model only for a Gemma 4 target (its assistant); "
            "other families' MTP layers are the target checkpoint's own"
        )
    if gemma4:
        return load_gemma4_assistant(assistant, c, init).to(device)
    if setup.quant_method is not None or setup.source.gguf_original:
        raise ConfigError(
            "speculative_config: mtp loads float checkpoints only (no quantization or GGUF) yet"
        )
    if model_type in QWEN_MTP_MODEL_TYPES and isinstance(target, Qwen3NextForCausalLM):
        return load_qwen_mtp(setup, target, init, device)
    if model_type not in MTP_MODEL_TYPES:
        raise ConfigError(
            "speculative_config: mtp runs the MTP layers of "
            f"{', '.join(MTP_MODEL_TYPES + QWEN_MTP_MODEL_TYPES)} checkpoints, not {model_type!r}"
        )
    if not getattr(c, "num_nextn_predict_layers", 0):
        raise ConfigError("speculative_config: the checkpoint has no MTP layers (num_nextn_predict_layers)")
    with torch.device(device):
        head = MTPHead(init, target)
    prefix = f"model.layers.{head.index}."
    tensors = [
        (n, t) for n, t in iter_checkpoint_weights(setup.source.directory, lazy=True) if n.startswith(prefix)
    ]
    # the family's own loader (its table of fused checkpoint names) with the head as the model
    loaded = type(target).load_weights(head, tensors)
    missing = sorted(
        n for n, _ in head.named_parameters() if n not in loaded and not n.startswith("embed_tokens")
    )
    if missing:
        raise ConfigError(f"speculative_config: the checkpoint's MTP layer lacks {', '.join(missing[:6])}")
    return head.eval().requires_grad_(False)


def make_mtp_proposer(
    head: MTPHead,
    kv_caches: list[torch.Tensor],
    backend: Any,
    block_size: int,
    batch: Any,
    device: torch.device,
) -> ChainedHeadProposer:
    """The proposer over the target's final hidden states (`StepInputs.hidden`)."""
    return ChainedHeadProposer(
        "mtp", head, lambda step: step.hidden, kv_caches, backend, block_size, batch, device
    )


def make_assistant_proposer(
    head: Gemma4AssistantHead,
    target: nn.Module,
    kv_caches: list[torch.Tensor],
    group_of: Any,
    backend: Any,
    block_size: int,
    batch: Any,
    device: torch.device,
) -> SharedKVHeadProposer:
    """The proposer of a Gemma 4 assistant over the target's caches and final hidden states, fed the
    target's scaled token embedding (not a multimodal model's, which would merge image rows)."""
    model = target.model
    return SharedKVHeadProposer(
        "mtp",
        head,
        partial(Gemma4Model.embed, model),
        kv_caches,
        group_of,
        backend,
        block_size,
        batch,
        device,
    )
