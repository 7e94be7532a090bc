"""The vision towers of vision-language models: CLIP's vision transformer (`CLIPVisionModel`) and SigLIP's
(`SiglipVisionModel`), as LLaVA and Gemma 3 read them: the hidden states of some encoder layers, or SigLIP's
last hidden state after its final layer norm, never the pooled output.

Both are the same pre-norm transformer over an image's patches. CLIP adds a class embedding in front of
the patches and a layer norm before the first layer and uses quick_gelu; SigLIP has neither and uses the
tanh gelu; either way the activation is the config's `hidden_act`. The layers after the deepest hidden
state asked for and SigLIP's pooling head never run and are not built; SigLIP's final layer norm is built
for a model that reads its `last_hidden_state` (Gemma 3).

Attention is non-causal over one image's patches with torch's `F.scaled_dot_product_attention`: it runs
outside the paged KV cache, since an image is encoded once and nothing of it is kept but the output.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.core.errors import ConfigError
from pagellm.models.layers.activation import get_activation
from pagellm.models.layers.linear import Linear

TOWERS = ("clip_vision_model", "siglip_vision_model")

STACKED = (("qkv", "q_proj", 0), ("qkv", "k_proj", 1), ("qkv", "v_proj", 2))
"""Checkpoint q/k/v projections -> the fused `qkv` (not `qkv_proj`: LoRA targets the decoder's by that name)."""


def hidden_state_indices(feature_layer: int | list[int], num_layers: int) -> list[int]:
    """Non-negative indices into the tower's hidden states (0: the embeddings, i: layer i's output) of
    `vision_feature_layer`, an index or a list of them, negative ones counting from the last layer."""
    layers = [feature_layer] if isinstance(feature_layer, int) else list(feature_layer)
    resolved = [i + num_layers + 1 if i < 0 else i for i in layers]
    if any(not 0 <= i <= num_layers for i in resolved):
        raise ConfigError(f"vision_feature_layer {feature_layer} is outside the tower's {num_layers} layers")
    return resolved


class VisionEmbeddings(nn.Module):
    """Patches by a stride-`patch_size` convolution, CLIP's class embedding in front, learned positions."""

    def __init__(self, config: Any, dtype: torch.dtype, class_token: bool):
        super().__init__()
        size, patch = config.hidden_size, config.patch_size
        self.patch_embedding = nn.Conv2d(
            config.num_channels, size, patch, stride=patch, bias=not class_token, dtype=dtype
        )
        self.class_embedding = nn.Parameter(torch.empty(size, dtype=dtype)) if class_token else None
        positions = (config.image_size // patch) ** 2 + class_token
        self.position_embedding = nn.Embedding(positions, size, dtype=dtype)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[B, C, H, W] -> [B, positions, hidden]; the image must be the config's `image_size`."""
        h = self.patch_embedding(pixel_values).flatten(2).transpose(1, 2)
        if self.class_embedding is not None:
            h = torch.cat([self.class_embedding.expand(h.shape[0], 1, -1), h], dim=1)
        return h + self.position_embedding.weight


class VisionAttention(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype):
        super().__init__()
        size = config.hidden_size
        self.num_heads, self.head_dim = config.num_attention_heads, size // config.num_attention_heads
        self.qkv = Linear(size, 3 * size, True, dtype, output_sizes=[size] * 3)
        self.out_proj = Linear(size, size, True, dtype)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        batch, length, size = h.shape
        qkv = self.qkv(h.reshape(-1, size)).view(batch, length, 3, self.num_heads, self.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each [B, heads, length, head_dim]
        out = F.scaled_dot_product_attention(q, k, v)
        return self.out_proj(out.transpose(1, 2).reshape(-1, size)).view(batch, length, size)


class VisionMLP(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype):
        super().__init__()
        self.fc1 = Linear(config.hidden_size, config.intermediate_size, True, dtype)
        self.act = get_activation(config.hidden_act)
        self.fc2 = Linear(config.intermediate_size, config.hidden_size, True, dtype)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(h.reshape(-1, h.shape[-1])))).view(h.shape)


class VisionEncoderLayer(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype):
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps, dtype=dtype)
        self.self_attn = VisionAttention(config, dtype)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps, dtype=dtype)
        self.mlp = VisionMLP(config, dtype)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + self.self_attn(self.layer_norm1(h))
        return h + self.mlp(self.layer_norm2(h))


class VisionEncoder(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype, num_layers: int):
        super().__init__()
        self.layers = nn.ModuleList(VisionEncoderLayer(config, dtype) for _ in range(num_layers))


class VisionTransformer(nn.Module):
    """CLIP's or SigLIP's vision transformer (by `config.model_type`), built up to hidden state
    `num_states - 1`: its parameters are named as the checkpoint's under the tower's prefix."""

    def __init__(self, config: Any, dtype: torch.dtype, num_states: int, post_layernorm: bool = False):
        """`post_layernorm`: build SigLIP's final layer norm too, for `last_hidden_state` (Gemma 3)."""
        super().__init__()
        if config.model_type not in TOWERS:
            raise ConfigError(
                f"vision tower {config.model_type!r} is not supported; supported: {', '.join(TOWERS)}"
            )
        clip = config.model_type == "clip_vision_model"
        if post_layernorm and clip:
            raise ConfigError("CLIP's post_layernorm normalises its pooled output, not its hidden states")
        self.embeddings = VisionEmbeddings(config, dtype, class_token=clip)
        eps = config.layer_norm_eps
        self.pre_layrnorm = nn.LayerNorm(config.hidden_size, eps=eps, dtype=dtype) if clip else None
        self.encoder = VisionEncoder(config, dtype, num_states - 1)
        self.post_layernorm = (
            nn.LayerNorm(config.hidden_size, eps=eps, dtype=dtype) if post_layernorm else None
        )

    def forward(self, pixel_values: torch.Tensor) -> list[torch.Tensor]:
        """Hidden states 0 (the embeddings, after CLIP's pre-layernorm) to `num_states - 1` (the output of
        that layer), each [B, positions, hidden]."""
        h = self.embeddings(pixel_values.to(self.embeddings.patch_embedding.weight.dtype))
        if self.pre_layrnorm is not None:
            h = self.pre_layrnorm(h)
        states = [h]
        for layer in self.encoder.layers:
            h = layer(h)
            states.append(h)
        return states

    def last_hidden_state(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """SigLIP's `last_hidden_state` [B, positions, hidden]: the last layer's output after the final layer
        norm (a tower built with every layer and `post_layernorm`)."""
        return self.post_layernorm(self(pixel_values)[-1])

    def keeps(self, name: str) -> bool:
        """Whether checkpoint tensor `name` (relative to the tower) belongs to what this tower built: not
        the final layer norm, SigLIP's pooling head, layers past the last one read, nor the position ids
        that older checkpoints stored."""
        if name.startswith("post_layernorm."):
            return self.post_layernorm is not None
        if name.startswith("head.") or name.endswith("position_ids"):
            return False
        if name.startswith("encoder.layers."):
            return int(name.split(".")[2]) < len(self.encoder.layers)
        return True
