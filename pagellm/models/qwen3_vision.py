"""Qwen3-VL's vision encoder (`Qwen3VLVisionModel`): Qwen2.5-VL's patches, 2D rotary and non-causal
attention (models/qwen_vision.py), with what Qwen3-VL changes:

- a learned position embedding on a square grid (`num_position_embeddings` = side^2), resampled to each
  image's grid of patches bilinearly with aligned corners and added to the patch embeddings (the patch
  embedding has a bias);
- every block attends over the whole frame (no windows), with LayerNorm and a plain GELU MLP;
- the merger normalises each patch before concatenating its merge group (LayerNorm), and besides the final
  merger, "deepstack" mergers take the hidden states after the blocks in `deepstack_visual_indexes`,
  normalising the concatenated group instead. Their outputs, one row per image token each, are added to
  the decoder's hidden states after its first layers (models/qwen3_vl.py).

Patches come in the processor's block-major order (each merge group's rows adjacent), as for Qwen2.5-VL.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagellm.models.layers.activation import get_activation
from pagellm.models.layers.linear import Linear
from pagellm.models.qwen_vision import VisionAttention, VisionPatchEmbed, grid_position_ids, grid_rotary

EPS = 1e-6
"""The vision encoder's LayerNorm epsilon (fixed in transformers, not in the config)."""


def position_taps(
    grids: list[tuple[int, int, int]], merge: int, side: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each patch's four taps into the side x side position table and their bilinear weights ([N, 4]
    each), as `F.interpolate(mode="bilinear", align_corners=True)` resamples the table to the image's
    grid (transformers' `get_vision_interpolation_indices_and_weights`)."""
    positions = grid_position_ids(grids, merge)
    sizes = torch.cat([torch.tensor([[h, w]]).expand(t * h * w, 2) for t, h, w in grids])
    src = positions.float() * (side - 1) / torch.clamp(sizes - 1, min=1)  # [N, (row, col)]
    floor = torch.floor(src)
    offsets = torch.arange(2)
    taps = (floor.long()[..., None] + offsets).clamp(0, side - 1)  # [N, 2, 2]
    weights = (1 - (src[..., None] - floor[..., None] - offsets).abs()).clamp(min=0)
    indices = (taps[:, 0, :, None] * side + taps[:, 1, None, :]).reshape(-1, 4)
    return indices, (weights[:, 0, :, None] * weights[:, 1, None, :]).reshape(-1, 4)


class Qwen3VisionMLP(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype):
        super().__init__()
        self.linear_fc1 = Linear(config.hidden_size, config.intermediate_size, True, dtype)
        self.linear_fc2 = Linear(config.intermediate_size, config.hidden_size, True, dtype)
        self.act = get_activation(config.hidden_act)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(h)))


class Qwen3VisionBlock(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype):
        super().__init__()
        self.norm1 = nn.LayerNorm(config.hidden_size, eps=EPS, dtype=dtype)
        self.norm2 = nn.LayerNorm(config.hidden_size, eps=EPS, dtype=dtype)
        self.attn = VisionAttention(config, dtype)
        self.mlp = Qwen3VisionMLP(config, dtype)

    def forward(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sequences: list[int]
    ) -> torch.Tensor:
        h = h + self.attn(self.norm1(h), cos, sin, sequences)
        return h + self.mlp(self.norm2(h))


class Qwen3PatchMerger(nn.Module):
    """Each merge group's rows concatenated through Linear, GELU, Linear into `out_hidden_size`; LayerNorm
    over each row before (the final merger) or over the concatenation (`after_concat`: the deepstack ones)."""

    def __init__(self, config: Any, dtype: torch.dtype, after_concat: bool):
        super().__init__()
        self.width = config.hidden_size * config.spatial_merge_size**2
        self.after_concat = after_concat
        self.norm = nn.LayerNorm(self.width if after_concat else config.hidden_size, eps=EPS, dtype=dtype)
        self.linear_fc1 = Linear(self.width, self.width, True, dtype)
        self.act = nn.GELU()
        self.linear_fc2 = Linear(self.width, config.out_hidden_size, True, dtype)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = self.norm(h.view(-1, self.width)) if self.after_concat else self.norm(h).view(-1, self.width)
        return self.linear_fc2(self.act(self.linear_fc1(h)))


class Qwen3VisionTransformer(nn.Module):
    """Parameters named as the checkpoint's under `visual.`."""

    def __init__(self, config: Any, dtype: torch.dtype):
        super().__init__()
        self.config = config
        self.merge = config.spatial_merge_size
        self.side = int(config.num_position_embeddings**0.5)
        self.patch_embed = VisionPatchEmbed(config, dtype, bias=True)
        self.pos_embed = nn.Embedding(config.num_position_embeddings, config.hidden_size, dtype=dtype)
        self.blocks = nn.ModuleList(Qwen3VisionBlock(config, dtype) for _ in range(config.depth))
        self.merger = Qwen3PatchMerger(config, dtype, after_concat=False)
        self.deepstack_indexes = list(config.deepstack_visual_indexes)
        self.deepstack_merger_list = nn.ModuleList(
            Qwen3PatchMerger(config, dtype, after_concat=True) for _ in self.deepstack_indexes
        )

    def forward(
        self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """All images' patches [sum(t*h*w), C*T*P*P] -> their tokens [sum(t*h*w) / merge^2, out_hidden] and
        the deepstack mergers' tokens of the same shape, in `deepstack_visual_indexes` order."""
        indices, weights = (x.to(pixels.device) for x in position_taps(grids, self.merge, self.side))
        h = self.patch_embed(pixels)
        h = h + (self.pos_embed(indices) * weights[:, :, None]).sum(1).to(h.dtype)
        cos, sin = grid_rotary(self.config, grids, self.merge, pixels.device)
        frames = [rows * cols for t, rows, cols in grids for _ in range(t)]
        deepstack = []
        for i, block in enumerate(self.blocks):
            h = block(h, cos, sin, frames)
            if i in self.deepstack_indexes:
                deepstack.append(self.deepstack_merger_list[self.deepstack_indexes.index(i)](h))
        return self.merger(h), deepstack
