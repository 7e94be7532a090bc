"""An EAGLE-3 draft head: one Llama-style decoder layer over [embed(token); fc(target hidden states)].

The head reads three of the target's hidden states (the residual stream entering three decoder layers,
low, middle and high), concatenated and projected by `fc` to its width, and the embedding of the token
after them. Its layer norms the two halves apart (`input_layernorm`, `hidden_norm`), attends with q/k/v
over the 2H-wide concatenation, and adds the hidden half back as the residual (vLLM's `llama_eagle3.py`).
Its output before the final norm is the next draft step's hidden state; after the norm, `lm_head` gives
logits over its draft vocabulary, which `d2t` maps to the target's (target id = draft id + d2t[id]).

Two checkpoint layouts load: EAGLE-3's own (`LlamaForCausalLMEagle3`-style config, `midlayer.*`) and
the `speculators` package's (`speculators_model_type: eagle3`, the layer's config in
`transformer_layer_config`, `layers.0.*`). Both keep `fc`, `norm`, `lm_head`, `d2t` and `t2d`, and may
leave out `embed_tokens` (then the target's is shared).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pagellm.core.errors import ConfigError
from pagellm.core.native_decode import DenseLayer, DraftHead
from pagellm.models.context import ModelInit
from pagellm.models.layers.linear import Linear
from pagellm.models.layers.norm import RMSNorm
from pagellm.models.layers.rotary import RotaryEmbedding
from pagellm.models.llama import STACKED, LlamaAttention, LlamaMLP, projection_of
from pagellm.models.loader import copy_weights, iter_checkpoint_weights


@dataclass(frozen=True)
class Eagle3Config:
    """What a head's config.json says, whichever layout: the decoder layer's Llama config and the rest."""

    layer: Any  # transformers.LlamaConfig of the one decoder layer
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: tuple[int, ...] | None  # None: vLLM's default for the target, (2, L // 2, L - 3)
    norm_before_residual: bool


def read_eagle3_config(path: str | Path) -> Eagle3Config:
    """The head's config from either layout; a ConfigError naming what cannot run."""
    from transformers import LlamaConfig

    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        raise ConfigError(f"speculative_config.model: no config.json in {path} (an EAGLE-3 head's directory)")
    raw = json.loads(config_file.read_text())
    if "speculators_model_type" in raw:
        if raw["speculators_model_type"] != "eagle3":
            raise ConfigError(
                f"speculative_config.model: a speculators {raw['speculators_model_type']!r} head; "
                "method eagle3 loads speculators_model_type 'eagle3'"
            )
        if raw.get("norm_before_fc"):
            raise ConfigError("speculative_config.model: norm_before_fc heads are not supported")
        layer_dict = dict(raw.get("transformer_layer_config") or {})
        aux = raw.get("eagle_aux_hidden_state_layer_ids")
    else:
        architectures = " ".join(raw.get("architectures") or [])
        if "eagle3" not in architectures.lower():
            raise ConfigError(
                f"speculative_config.model: {path} is not an EAGLE-3 head (architectures {architectures!r}, "
                "no speculators_model_type)"
            )
        layer_dict = {k: v for k, v in raw.items() if k not in ("architectures", "model_type")}
        aux = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    layer_dict.pop("model_type", None)
    layer = LlamaConfig(**layer_dict)
    if layer.num_hidden_layers != 1:
        raise ConfigError(
            f"speculative_config.model: an EAGLE-3 head has one decoder layer, this one {layer.num_hidden_layers}"
        )
    return Eagle3Config(
        layer=layer,
        draft_vocab_size=int(raw.get("draft_vocab_size") or layer.vocab_size),
        target_hidden_size=int(raw.get("target_hidden_size") or layer.hidden_size),
        aux_layer_ids=tuple(int(i) for i in aux) if aux else None,
        norm_before_residual=bool(raw.get("norm_before_residual", False)),
    )


class Eagle3Layer(nn.Module):
    """The head's decoder layer: attention over [input_layernorm(embeds); hidden_norm(hidden)], 2H wide."""

    def __init__(self, init: ModelInit, norm_before_residual: bool):
        super().__init__()
        c = init.hf_config
        bias = bool(getattr(c, "attention_bias", False))
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, init.dtype)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, init.dtype)
        self.self_attn = LlamaAttention(init, 0, bias, False)
        sizes = [self.self_attn.q_size, self.self_attn.kv_size, self.self_attn.kv_size]
        self.self_attn.qkv_proj = Linear(2 * c.hidden_size, sum(sizes), bias, init.dtype, None, sizes)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, init.dtype)
        self.mlp = LlamaMLP(init)
        self.norm_before_residual = norm_before_residual

    def forward(
        self, embeds: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.norm_before_residual:
            hidden = residual = self.hidden_norm(hidden)
        else:
            residual, hidden = hidden, self.hidden_norm(hidden)
        h = self.self_attn(torch.cat([self.input_layernorm(embeds), hidden], dim=-1), cos, sin)
        h, residual = self.post_attention_layernorm.add_and_norm(h, residual)
        return self.mlp(h), residual


class Eagle3Head(nn.Module):
    def __init__(self, init: ModelInit, config: Eagle3Config):
        super().__init__()
        c = init.hf_config
        self.config = config
        self.embed_tokens: nn.Module | None = None  # set by `load_eagle3_head`: its own or the target's
        self.fc = Linear(3 * config.target_hidden_size, c.hidden_size, False, init.dtype)
        self.layers = nn.ModuleList([Eagle3Layer(init, config.norm_before_residual)])
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, init.dtype)
        self.lm_head = Linear(c.hidden_size, config.draft_vocab_size, False, init.dtype)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.int64))
        self.rotary_emb = RotaryEmbedding(c)

    def attention_layers(self) -> list[nn.Module]:
        return [self.layers[0].self_attn.attn]

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(normed output, output before the norm) for tokens `input_ids` at `positions` with `hidden`
        (the head's width: `fc` of the target's, or the head's own output of the step before)."""
        cos, sin = self.rotary_emb.cos_sin(positions)
        h, residual = self.layers[0](self.embed_tokens(input_ids), hidden, cos, sin)
        return self.norm.add_and_norm(h, residual)

    def draft_head(self) -> DraftHead | str:
        """The head as a platform's native pass takes it (`core/native_decode.py`), or why it cannot."""
        layer, rope, embed = self.layers[0], self.rotary_emb, self.embed_tokens
        attn, mlp = layer.self_attn, layer.mlp
        if rope.by_length or rope.rotary_dim != attn.head_dim or rope.inv_freq.dim() != 1:
            return "its rotary embedding depends on the sequence's length or covers part of each head"
        lookup = getattr(embed, "lookup", None)
        if (lookup is not None and embed.block_type is None) or getattr(embed, "group", None) is not None:
            return "its token embedding is packed or split"
        norms = [layer.input_layernorm, layer.hidden_norm, layer.post_attention_layernorm, self.norm]
        if len({n.eps for n in norms}) != 1:
            return "its norms' eps differ"
        return DraftHead(
            embedding=embed.packed_table if lookup is not None else embed.weight,
            embedding_type=embed.block_type if lookup is not None else None,
            layer=DenseLayer(
                layer.input_layernorm.weight,
                layer.post_attention_layernorm.weight,
                projection_of(attn.qkv_proj),
                projection_of(attn.o_proj),
                projection_of(mlp.gate_up_proj),
                projection_of(mlp.down_proj),
            ),
            hidden_norm=layer.hidden_norm.weight,
            norm_before_residual=layer.norm_before_residual,
            final_norm=self.norm.weight,
            lm_head=projection_of(self.lm_head),
            d2t=self.d2t,
            inv_freq=rope.inv_freq,
            rope_scaling=rope.scaling,
            eps=self.norm.eps,
            hidden_size=self.norm.weight.numel(),
            num_heads=attn.num_heads,
            num_kv_heads=attn.num_kv_heads,
            head_size=attn.head_dim,
            intermediate_size=mlp.gate_up_proj.out_features // 2,
            activation=self.config.layer.hidden_act,
            dtype=self.norm.weight.dtype,
        )

    def greedy_tokens(self, normed: torch.Tensor) -> torch.Tensor:
        """The argmax of each row's draft logits, as a target token id."""
        draft_ids = self.lm_head(normed).float().argmax(dim=-1)
        return draft_ids + self.d2t[draft_ids]


def load_eagle3_head(path: str | Path, init: ModelInit, target_embed: nn.Module | None) -> Eagle3Head:
    """The head built on `init` (its hf_config is replaced by the head's layer config) with its weights,
    from either layout; `target_embed` is used where the checkpoint has no `embed_tokens`."""
    config = read_eagle3_config(path)
    target_vocab = getattr(init.hf_config, "vocab_size", None)
    if config.layer.vocab_size != target_vocab:
        raise ConfigError(
            f"speculative_config.model: the head's vocabulary ({config.layer.vocab_size} tokens) is not the "
            f"target's ({target_vocab}); an EAGLE-3 head must be trained for this target"
        )
    if config.target_hidden_size != init.hf_config.hidden_size:
        raise ConfigError(
            f"speculative_config.model: the head reads hidden states of width {config.target_hidden_size}, "
            f"the target's are {init.hf_config.hidden_size}"
        )
    head_init = ModelInit(config.layer, init.dtype, init.attention_backend, init.block_size,
                          kv_cache_dtype=init.kv_cache_dtype)  # fmt: skip
    head = Eagle3Head(head_init, config)
    names = {name for name, _ in head.named_parameters()} | {"d2t"}
    tensors = dict(_checkpoint_names(iter_checkpoint_weights(path)))
    if "embed_tokens.weight" in tensors:
        head.embed_tokens = nn.Embedding(config.layer.vocab_size, config.layer.hidden_size, dtype=init.dtype)
        head.embed_tokens.weight.requires_grad_(False)
        names.add("embed_tokens.weight")
    elif target_embed is None:
        raise ConfigError(
            "speculative_config.model: the head has no embed_tokens and the target's is not found"
        )
    else:
        head.embed_tokens = target_embed
    if config.draft_vocab_size != config.layer.vocab_size and "d2t" not in tensors:
        raise ConfigError(
            "speculative_config.model: the head's draft vocabulary is smaller but it has no d2t"
        )
    loaded = copy_weights(
        head, ((n, t.to(init.dtype) if n != "d2t" else t) for n, t in tensors.items()), STACKED
    )
    missing = sorted(n.replace(".qkv_proj.", ".q_proj.") for n in names - loaded - {"d2t"})
    if missing:
        raise ConfigError(f"speculative_config.model: the head's checkpoint lacks {', '.join(missing)}")
    if int((head.d2t + torch.arange(config.draft_vocab_size)).max()) >= config.layer.vocab_size:
        raise ConfigError("speculative_config.model: the head's d2t maps past the target's vocabulary")
    return head


def _checkpoint_names(weights) -> Any:
    """The checkpoint's tensors under the head's names: `midlayer.` is layer 0, a `model.` prefix is
    dropped, and `t2d` (the target-to-draft mask, which `d2t` already implies) is left out."""
    for name, tensor in weights:
        name = name.removeprefix("model.").replace("midlayer.", "layers.0.")
        if name != "t2d":
            yield name, tensor
