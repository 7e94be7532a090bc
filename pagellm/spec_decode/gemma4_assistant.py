"""Gemma 4's multi-token-prediction drafters: the `*-assistant` checkpoints Google ships beside each Gemma 4
model (`Gemma4AssistantForCausalLM`, model_type gemma4_assistant), as transformers' modeling_gemma4_assistant.py
and its `Gemma4AssistantCandidateGenerator` run them.

The assistant is a small Gemma 4 decoder whose layers compute queries only: each attends to the target's
KV of the last layer of its type that keeps one (the "store" layers, `kv_stores`), read in place from the
target's paged cache. Its input is the target's (scaled) embedding of the newest token beside the target's
final hidden state at the position before it, projected down (`pre_projection`); its normed output gives
the draft's logits through its own tied embedding, and, projected back up (`post_projection`), the hidden
state the next draft step reads in place of the target's. Every draft step of a round sits at the newest
token's position p and reads the same target KV, positions before p (so it keeps no KV of its own): a full
layer all of them, a sliding layer the last `sliding_window` + 1 (transformers' bidirectional window mask,
whose distance bound is inclusive, flipped to look back from the last cached token). E2B/E4B assistants
score only the tokens of the top `centroid_intermediate_top_k` of `num_centroids` vocabulary clusters
(`use_ordered_embeddings`): `token_ordering` lists each cluster's tokens.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pagellm.core.attention import AttentionSpec
from pagellm.core.errors import ConfigError
from pagellm.models.base import ModelInit
from pagellm.models.gemma4 import (
    SLIDING,
    Gemma4DecoderLayer,
    Gemma4RMSNorm,
    gemma4_attention_spec,
    kv_stores,
    layer_config,
    rotaries_by_layer_type,
)
from pagellm.models.layers.linear import Linear
from pagellm.models.llama import STACKED
from pagellm.models.loader import copy_weights, iter_checkpoint_weights

ASSISTANT_MODEL_TYPES = ("gemma4_assistant",)


class Gemma4AssistantHead(nn.Module):
    """The assistant's decoder over the target's KV: (target embedding, target hidden, position) -> (normed
    output, the hidden state for the next draft step)."""

    reads_target_kv = (
        True  # no KV cache of its own: the proposer hands it the target's (shared_kv_proposer.py)
    )

    def __init__(self, init: ModelInit, config: Any, target_config: Any):
        super().__init__()
        c = init.hf_config  # the assistant's text config
        self.stores = kv_stores(target_config)
        self.sources = [
            self.stores[t] for t in c.layer_types
        ]  # per layer: the target layer whose KV it reads
        target_specs = {
            i: gemma4_attention_spec(target_config, init.dtype, init.block_size, i) for i in self.sources
        }
        window = c.sliding_window + 1 if c.sliding_window else None

        def spec(_: Any, __: torch.dtype, ___: int, i: int) -> AttentionSpec:
            target, mine = target_specs[self.sources[i]], layer_config(c, i)
            if (mine.head_dim, mine.num_key_value_heads) != (target.head_size, target.num_kv_heads):
                raise ConfigError(
                    f"speculative_config.model: the assistant's {c.layer_types[i]} layers read KV heads of "
                    f"{mine.num_key_value_heads} x {mine.head_dim}, the target's are "
                    f"{target.num_kv_heads} x {target.head_size}: it was made for another Gemma 4"
                )
            sliding = c.layer_types[i] == SLIDING
            return dataclasses.replace(
                target,
                num_heads=mine.num_attention_heads,
                sliding_window=window if sliding else None,
                kv_source=self.sources[i],
            )

        dtype, hidden, backbone = init.dtype, c.hidden_size, config.backbone_hidden_size
        self.pre_projection = Linear(2 * backbone, hidden, False, dtype)
        self.post_projection = Linear(hidden, backbone, False, dtype)
        self.model = nn.Module()
        self.model.layers = nn.ModuleList(
            Gemma4DecoderLayer(init, i, c.attention_bias, False, spec) for i in range(c.num_hidden_layers)
        )
        self.model.norm = Gemma4RMSNorm(hidden, c.rms_norm_eps, dtype)
        self.rotaries, self.layer_rope = rotaries_by_layer_type(c)
        self.kv_sizes = [layer.self_attn.kv_size for layer in self.model.layers]
        self.vocab_size = c.vocab_size
        self.lm_head: Linear | None = None
        self.centroids: Linear | None = None
        if config.use_ordered_embeddings:
            # the tied embedding's rows, gathered per draft: a plain tensor (a packed linear has none)
            self.embedding = nn.Parameter(torch.empty(c.vocab_size, hidden, dtype=dtype), requires_grad=False)
            self.centroids = Linear(hidden, config.num_centroids, False, dtype)
            self.register_buffer("token_ordering", torch.empty(c.vocab_size, dtype=torch.int64))
            self.num_centroids = config.num_centroids
            self.top_centroids = config.centroid_intermediate_top_k
        else:
            self.lm_head = Linear(hidden, c.vocab_size, False, dtype)

    def attention_layers(self) -> list[nn.Module]:
        """None of its own KV: its layers read the target's (the runner allocates nothing for them)."""
        return []

    def reading_layers(self) -> list[nn.Module]:
        """Its attention layers, by its layer index."""
        return [layer.self_attn.attn for layer in self.model.layers]

    def forward(
        self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(normed output, the hidden state the next draft step reads); a forward context over the target's
        caches must be set. Each layer is handed empty K and V rows: the step's slots are negative (nothing
        stored), so the attention reads the target's cache alone."""
        x = self.pre_projection(torch.cat([embeds, hidden], dim=-1))
        rope = [rotary.cos_sin(positions) for rotary in self.rotaries]
        for i, layer in enumerate(self.model.layers):
            none = x.new_zeros(x.shape[0], self.kv_sizes[i])
            x, _, _ = layer(x, *rope[self.layer_rope[i]], None, (none, none))
        normed = self.model.norm(x)
        return normed, self.post_projection(normed)

    def greedy_tokens(self, normed: torch.Tensor) -> torch.Tensor:
        """Each row's argmax over the vocabulary, or over the tokens of its top clusters (ordered embeddings:
        transformers sets every other token's logit below the smallest of these)."""
        if self.lm_head is not None:
            return self.lm_head(normed).float().argmax(dim=-1)
        top = self.centroids(normed).topk(self.top_centroids, dim=-1).indices  # [T, top]
        clusters = self.token_ordering.view(self.num_centroids, -1)
        candidates = clusters[top].reshape(normed.shape[0], -1)  # [T, top * tokens per cluster]
        logits = torch.bmm(self.embedding[candidates], normed.unsqueeze(-1)).squeeze(-1)
        return candidates.gather(1, logits.float().argmax(dim=-1, keepdim=True)).squeeze(1)


def load_gemma4_assistant(path: str | Path, target_config: Any, init: ModelInit) -> Gemma4AssistantHead:
    """The assistant of directory `path` for a Gemma 4 target (`target_config`, its text config; `init`, the
    target's `ModelInit`); a ConfigError naming what does not fit."""
    from transformers import AutoConfig

    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        raise ConfigError(
            f"speculative_config.model: no config.json in {path} (a Gemma 4 assistant's directory)"
        )
    model_type = json.loads(config_file.read_text()).get("model_type")
    if model_type not in ASSISTANT_MODEL_TYPES:
        raise ConfigError(
            f"speculative_config.model: mtp with a model runs a Gemma 4 assistant ({', '.join(ASSISTANT_MODEL_TYPES)}); "
            f"{path} is a {model_type!r} checkpoint"
        )
    config = AutoConfig.from_pretrained(str(path))
    text = config.text_config
    if config.backbone_hidden_size != target_config.hidden_size:
        raise ConfigError(
            f"speculative_config.model: the assistant reads hidden states of width {config.backbone_hidden_size}, "
            f"the target's are {target_config.hidden_size}: it was made for another Gemma 4"
        )
    if text.vocab_size != target_config.vocab_size:
        raise ConfigError(
            f"speculative_config.model: the assistant's vocabulary ({text.vocab_size} tokens) is not the "
            f"target's ({target_config.vocab_size})"
        )
    if config.use_ordered_embeddings and text.vocab_size % config.num_centroids:
        raise ConfigError(
            f"speculative_config.model: {config.num_centroids} centroids do not split the vocabulary evenly"
        )
    window = getattr(target_config, "sliding_window", None)
    if text.sliding_window and window and text.sliding_window > window:
        raise ConfigError(
            f"speculative_config.model: the assistant's window ({text.sliding_window}) is wider than the "
            f"target's ({window}), whose sliding layers keep no KV that far back"
        )
    head_init = ModelInit(text, init.dtype, init.attention_backend, init.block_size,
                          kv_cache_dtype=init.kv_cache_dtype)  # fmt: skip
    head = Gemma4AssistantHead(head_init, config, target_config)
    tied = "embedding" if head.lm_head is None else "lm_head.weight"

    def named(name: str) -> str:
        if name == "model.embed_tokens.weight":
            return tied
        return name.removeprefix("masked_embedding.")

    tensors = ((named(n), t) for n, t in iter_checkpoint_weights(path) if n != "lm_head.weight")
    loaded = copy_weights(
        head, ((n, t if n == "token_ordering" else t.to(init.dtype)) for n, t in tensors), STACKED
    )
    expected = {n for n, _ in head.named_parameters()} | (
        {"token_ordering"} if head.lm_head is None else set()
    )
    missing = sorted(n.replace(".qkv_proj.", ".q_proj.") for n in expected - loaded)
    if missing:
        raise ConfigError(f"speculative_config.model: the assistant's checkpoint lacks {', '.join(missing)}")
    return head.eval().requires_grad_(False)
