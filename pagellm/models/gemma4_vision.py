"""Gemma 4's vision encoder (`Gemma4VisionModel`) and the projection of its output into the decoder's width
(`Gemma4MultimodalEmbedder`), as transformers' modeling_gemma4.py computes them:

- the processor cuts an image (resized to keep its aspect ratio within a patch budget) into patches of
  `patch_size`² x 3 pixels in [0, 1], each with its (x, y) place in the patch grid, and pads every image to
  the budget with patches at (-1, -1); the encoder maps the pixels to [-1, 1], projects each patch and adds
  a learned embedding per x and per y (none for a padding patch)
- each layer is Gemma 4's text layer in miniature: four RMSNorms scaled by w, q/k norms and a weightless v
  norm, an attention scale of 1, a gated MLP; the rope is 2-D: the first half of each head rotates by the
  patch's x, the second half by its y (the same frequencies on both); padding patches are masked as keys
- the last hidden states are averaged over k x k tiles of the grid (k from the budget and the output
  length), padding patches counting as zeros, scaled by sqrt(hidden) in float32, the padding tiles dropped,
  and standardised where the config says so (`std_bias`, `std_scale`)
- the embedder normalises each row without a weight and projects it to the decoder's width

`use_clipped_linears` checkpoints clamp the inputs and outputs of every linear map in the encoder to their
stored bounds. Attention runs with `F.scaled_dot_product_attention` over one image's patches, outside the
paged KV cache, as the other vision towers do (models/vision.py).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.core.errors import ConfigError
from pagellm.models.gemma4 import Gemma4RMSNorm
from pagellm.models.layers.activation import get_activation
from pagellm.models.layers.linear import Linear
from pagellm.models.layers.rotary import apply_rotary


class ClippableLinear(nn.Module):
    """A linear map without bias (`linear`), its input and output clamped to stored bounds where the
    checkpoint has them (`use_clipped_linears`); transformers' names, so the bounds load as they are."""

    def __init__(self, config: Any, in_size: int, out_size: int, dtype: torch.dtype):
        super().__init__()
        self.linear = Linear(in_size, out_size, False, dtype)
        self.clipped = bool(config.use_clipped_linears)
        if self.clipped:
            for name in ("input_min", "input_max", "output_min", "output_max"):
                bound = float("-inf") if name.endswith("min") else float("inf")
                self.register_buffer(name, torch.tensor(bound))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.clipped:
            x = torch.clamp(x, self.input_min, self.input_max)
        out = self.linear(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], -1)
        return torch.clamp(out, self.output_min, self.output_max) if self.clipped else out


class Gemma4VisionPatchEmbedder(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype):
        super().__init__()
        self.input_proj = Linear(3 * config.patch_size**2, config.hidden_size, False, dtype)
        self.position_embedding_table = nn.Parameter(
            torch.empty(2, config.position_embedding_size, config.hidden_size, dtype=dtype),
            requires_grad=False,
        )

    def forward(self, pixels: torch.Tensor, positions: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
        """pixels [B, P, 3 x patch²] in [0, 1], positions [B, P, 2] -> [B, P, hidden]."""
        # no normalisation in the processor; the dtype from the table (input_proj's weight may be packed away)
        pixels = (2 * (pixels - 0.5)).to(self.position_embedding_table.dtype)
        h = self.input_proj(pixels.reshape(-1, pixels.shape[-1])).view(*pixels.shape[:2], -1)
        where = positions.clamp(min=0)
        table = self.position_embedding_table
        embedded = F.embedding(where[..., 0], table[0]) + F.embedding(where[..., 1], table[1])
        return h + torch.where(padding.unsqueeze(-1), 0.0, embedded)


class Gemma4VisionRotary(nn.Module):
    """The axial 2-D rope: a quarter of the head's size in frequencies, shared by x and y."""

    def __init__(self, config: Any):
        super().__init__()
        params = config.rope_parameters
        if params.get("rope_type") != "axial":
            raise ConfigError(f"Gemma 4's vision rope must be axial, not {params.get('rope_type')!r}")
        spatial = config.head_dim // 2
        inv_freq = 1.0 / (params["rope_theta"] ** (torch.arange(0, spatial, 2, dtype=torch.float) / spatial))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B, P, 2] -> cos, sin [B x P, 2, head_dim / 4] (x's, then y's)."""
        freqs = positions.reshape(-1, 2)[..., None].float() * self.inv_freq
        return freqs.cos(), freqs.sin()


class Gemma4VisionAttention(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype):
        super().__init__()
        size, eps = config.hidden_size, config.rms_norm_eps
        self.heads, self.kv_heads, self.head_dim = (
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
        )
        self.q_proj = ClippableLinear(config, size, self.heads * self.head_dim, dtype)
        self.k_proj = ClippableLinear(config, size, self.kv_heads * self.head_dim, dtype)
        self.v_proj = ClippableLinear(config, size, self.kv_heads * self.head_dim, dtype)
        self.o_proj = ClippableLinear(config, self.heads * self.head_dim, size, dtype)
        self.q_norm = Gemma4RMSNorm(self.head_dim, eps, dtype)
        self.k_norm = Gemma4RMSNorm(self.head_dim, eps, dtype)
        self.v_norm = Gemma4RMSNorm(self.head_dim, eps, dtype, with_scale=False)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [B x P, heads, head_dim]: its first half rotated by x's angles, its second by y's."""
        halves = x.chunk(2, dim=-1)
        return torch.cat([apply_rotary(halves[i], cos[:, i], sin[:, i]) for i in range(2)], dim=-1)

    def forward(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, keys: torch.Tensor
    ) -> torch.Tensor:
        """h [B, P, hidden]; `keys` [B, 1, 1, P]: True where a patch may be attended to (not padding)."""
        batch, length, _ = h.shape
        flat = (batch * length, -1, self.head_dim)
        q = self._rotate(self.q_norm(self.q_proj(h).reshape(flat)), cos, sin)
        k = self._rotate(self.k_norm(self.k_proj(h).reshape(flat)), cos, sin)
        v = self.v_norm(self.v_proj(h).reshape(flat))
        q, k, v = (t.view(batch, length, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=keys, scale=1.0, enable_gqa=self.heads != self.kv_heads
        )
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, -1))


class Gemma4VisionMLP(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype):
        super().__init__()
        size, inner = config.hidden_size, config.intermediate_size
        self.gate_proj = ClippableLinear(config, size, inner, dtype)
        self.up_proj = ClippableLinear(config, size, inner, dtype)
        self.down_proj = ClippableLinear(config, inner, size, dtype)
        self.act = get_activation(config.hidden_activation)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(h)) * self.up_proj(h))


class Gemma4VisionEncoderLayer(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype):
        super().__init__()
        norm = lambda: Gemma4RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)  # noqa: E731
        self.input_layernorm, self.post_attention_layernorm = norm(), norm()
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norm(), norm()
        self.self_attn = Gemma4VisionAttention(config, dtype)
        self.mlp = Gemma4VisionMLP(config, dtype)

    def forward(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, keys: torch.Tensor
    ) -> torch.Tensor:
        h = h + self.post_attention_layernorm(self.self_attn(self.input_layernorm(h), cos, sin, keys))
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class Gemma4VisionEncoder(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype):
        super().__init__()
        self.rotary_emb = Gemma4VisionRotary(config)
        self.layers = nn.ModuleList(
            Gemma4VisionEncoderLayer(config, dtype) for _ in range(config.num_hidden_layers)
        )


class Gemma4VisionModel(nn.Module):
    """The encoder from padded patches to each image's soft tokens (pooled, scaled, standardised)."""

    def __init__(self, config: Any, dtype: torch.dtype):
        super().__init__()
        self.kernel = config.pooling_kernel_size
        self.root_hidden = config.hidden_size**0.5
        self.patch_embedder = Gemma4VisionPatchEmbedder(config, dtype)
        self.encoder = Gemma4VisionEncoder(config, dtype)
        self.standardize = bool(config.standardize)
        if self.standardize:
            self.register_buffer("std_bias", torch.zeros(config.hidden_size, dtype=dtype))
            self.register_buffer("std_scale", torch.ones(config.hidden_size, dtype=dtype))

    def forward(self, pixels: torch.Tensor, positions: torch.Tensor) -> list[torch.Tensor]:
        """pixels [B, P, 3 x patch²], positions [B, P, 2] (padding at -1) -> per image its soft tokens
        [its non-padding patches / kernel², hidden], in the weights' dtype."""
        padding = (positions == -1).all(dim=-1)
        h = self.patch_embedder(pixels, positions, padding)
        cos, sin = self.encoder.rotary_emb(positions)
        keys = ~padding[:, None, None, :]
        for layer in self.encoder.layers:
            h = layer(h, cos, sin, keys)
        pooled, valid = self._pool(h.masked_fill(padding.unsqueeze(-1), 0.0), positions, padding)
        pooled = pooled.float() * self.root_hidden  # past float16's range before standardising
        if self.standardize:
            pooled = (pooled - self.std_bias.float()) * self.std_scale.float()
        return [rows[keep].to(h.dtype) for rows, keep in zip(pooled, valid, strict=True)]

    def _pool(
        self, h: torch.Tensor, positions: torch.Tensor, padding: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Average over kernel x kernel tiles of the grid into P / kernel² rows (each row's tile by the
        patches' positions; the padding patches, all zero, land in tile 0 or none), and which rows hold a
        tile of the image."""
        length = h.shape[1] // self.kernel**2
        if length == h.shape[1]:
            return h, ~padding
        where = positions.clamp(min=0)
        width = where[..., 0].max(dim=-1, keepdim=True)[0] + 1
        tile = torch.div(where, self.kernel, rounding_mode="floor")
        tile = tile[..., 0] + (width // self.kernel) * tile[..., 1]
        weights = F.one_hot(tile.long(), length).float() / self.kernel**2
        out = weights.transpose(1, 2) @ h.float()
        return out.to(h.dtype), (weights != 0).any(dim=1)


class Gemma4MultimodalEmbedder(nn.Module):
    """Soft tokens into the decoder's width: a weightless RMSNorm, then a projection without bias."""

    def __init__(self, vision_config: Any, text_config: Any, dtype: torch.dtype):
        super().__init__()
        size = getattr(vision_config, "output_proj_dims", None) or vision_config.hidden_size
        self.embedding_pre_projection_norm = Gemma4RMSNorm(
            size, vision_config.rms_norm_eps, dtype, with_scale=False
        )
        self.embedding_projection = Linear(size, text_config.hidden_size, False, dtype)

    def forward(self, soft_tokens: torch.Tensor) -> torch.Tensor:
        return self.embedding_projection(self.embedding_pre_projection_norm(soft_tokens))
