"""Qwen2.5-VL's vision encoder (`Qwen2_5_VisionTransformerPretrainedModel`): images of any size, cut by the
processor into (temporal_patch_size, patch, patch) patches, embedded, run through pre-norm blocks and merged
2 x 2 (`spatial_merge_size`) into the decoder's width, one row per image token.

- Patches come from the processor flattened, all images' in a row ([sum(t*h*w), C*T*P*P]) with each image's
  grid (t, h, w) in patches, the rows of each 2 x 2 merge group adjacent (block-major).
- Positions are a 2D rotary over each head: its first half rotates by the patch's row, the second half by
  its column, the same frequencies for both.
- Attention is non-causal, within one image in the `fullatt_block_indexes` blocks and within windows of
  `window_size` pixels (whole merge groups, windows at the image's edge smaller) in the others. As
  transformers does, the patches are reordered window by window before the blocks and back after the
  merger, so every block sees a window's patches contiguous. Each window or image is one sequence of
  `F.scaled_dot_product_attention`; sequences of the same length run as one batch.
- RMSNorm, a SwiGLU MLP with biases; the merger normalises, concatenates each merge group's four rows and
  runs a two-layer GELU MLP.

It runs outside the paged KV cache, like models/vision.py: an image is encoded once and only its output is
kept.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.models.layers.activation import get_activation
from pagellm.models.layers.linear import Linear
from pagellm.models.layers.norm import RMSNorm
from pagellm.models.layers.rotary import apply_rotary

EPS = 1e-6
"""The vision encoder's RMSNorm epsilon (fixed in transformers, not in the config)."""


def grid_position_ids(grids: list[tuple[int, int, int]], merge: int) -> torch.Tensor:
    """[N, 2] (row, column) of each patch in the processor's block-major order (merge x merge groups)."""
    out = []
    for t, h, w in grids:
        rows = torch.arange(h)[:, None].expand(h, w)
        cols = torch.arange(w)[None, :].expand(h, w)
        shape = (h // merge, merge, w // merge, merge)
        rows = rows.reshape(shape).transpose(1, 2).flatten()
        cols = cols.reshape(shape).transpose(1, 2).flatten()
        out.append(torch.stack([rows, cols], dim=-1).repeat(t, 1))
    return torch.cat(out)


def window_order(
    grids: list[tuple[int, int, int]], merge: int, window: int
) -> tuple[torch.Tensor, list[int], list[int]]:
    """(the merge groups in window order, each window's length in patches, each frame's length in patches).

    A window is `window` x `window` merge groups, taken row by row over each frame's grid of groups; the
    last row and column of windows are cut short where the grid is not a multiple of the window."""
    order, windows, frames = [], [], []
    first = 0
    for t, h, w in grids:
        gh, gw = h // merge, w // merge
        index = torch.arange(t * gh * gw).reshape(t, gh, gw) + first
        for frame in range(t):
            for top in range(0, gh, window):
                for left in range(0, gw, window):
                    block = index[frame, top : top + window, left : left + window].flatten()
                    order.append(block)
                    windows.append(block.numel() * merge * merge)
            frames.append(h * w)
        first += t * gh * gw
    return torch.cat(order), windows, frames


def grid_rotary(
    config: Any, grids: list[tuple[int, int, int]], merge: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [N, head_dim / 2] of each patch (block-major order): the first half of each head's
    frequencies turn with the patch's row, the second half with its column, the same frequencies for both."""
    head_dim = config.hidden_size // config.num_heads
    theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    spatial = head_dim // 2
    inv_freq = 1.0 / (theta ** (torch.arange(0, spatial, 2, dtype=torch.float) / spatial))
    positions = grid_position_ids(grids, merge).to(device)
    freqs = (positions[..., None].float() * inv_freq.to(device)).flatten(1)  # [N, (row, col) x freqs]
    return freqs.cos(), freqs.sin()


class VisionPatchEmbed(nn.Module):
    """A Conv3d over (channels, temporal_patch_size, patch, patch) patches; Qwen3-VL's has a bias."""

    def __init__(self, config: Any, dtype: torch.dtype, bias: bool = False):
        super().__init__()
        self.shape = (config.in_channels, config.temporal_patch_size, config.patch_size, config.patch_size)
        kernel = self.shape[1:]
        self.proj = nn.Conv3d(
            config.in_channels, config.hidden_size, kernel, stride=kernel, bias=bias, dtype=dtype
        )

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        h = self.proj(pixels.view(-1, *self.shape).to(self.proj.weight.dtype))
        return h.view(h.shape[0], -1)


class VisionAttention(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype):
        super().__init__()
        size = config.hidden_size
        self.num_heads, self.head_dim = config.num_heads, size // config.num_heads
        self.qkv = Linear(size, 3 * size, True, dtype)
        self.proj = Linear(size, size, True, dtype)

    def forward(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sequences: list[int]
    ) -> torch.Tensor:
        """`sequences`: the lengths of the runs of rows that attend to each other, in order."""
        length = h.shape[0]
        q, k, v = self.qkv(h).view(length, 3, self.num_heads, self.head_dim).unbind(1)
        # rotated in float32, as transformers rotates the vision encoder's q and k
        q = apply_rotary(q.float(), cos, sin).to(h.dtype)
        k = apply_rotary(k.float(), cos, sin).to(h.dtype)
        out = torch.empty_like(q)
        starts = torch.tensor([0, *sequences[:-1]]).cumsum(0)
        for size in sorted(set(sequences)):
            first = starts[torch.tensor(sequences) == size]
            rows = (first[:, None] + torch.arange(size)[None, :]).to(h.device)  # [sequences, size]
            heads = [x[rows].transpose(1, 2) for x in (q, k, v)]  # each [sequences, heads, size, head_dim]
            out[rows] = F.scaled_dot_product_attention(*heads).transpose(1, 2)
        return self.proj(out.reshape(length, -1))


class VisionMLP(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype):
        super().__init__()
        size, inner = config.hidden_size, config.intermediate_size
        self.gate_proj = Linear(size, inner, True, dtype)
        self.up_proj = Linear(size, inner, True, dtype)
        self.down_proj = Linear(inner, size, True, dtype)
        self.act = get_activation(config.hidden_act)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(h)) * self.up_proj(h))


class VisionBlock(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype):
        super().__init__()
        self.norm1 = RMSNorm(config.hidden_size, EPS, dtype)
        self.norm2 = RMSNorm(config.hidden_size, EPS, dtype)
        self.attn = VisionAttention(config, dtype)
        self.mlp = VisionMLP(config, dtype)

    def forward(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sequences: list[int]
    ) -> torch.Tensor:
        h = h + self.attn(self.norm1(h), cos, sin, sequences)
        return h + self.mlp(self.norm2(h))


class PatchMerger(nn.Module):
    """Each merge group's rows, normalised and concatenated, through Linear, GELU, Linear into `out_size`."""

    def __init__(self, size: int, out_size: int, merge: int, dtype: torch.dtype):
        super().__init__()
        self.width = size * merge * merge
        self.ln_q = RMSNorm(size, EPS, dtype)
        self.mlp = nn.Sequential(
            Linear(self.width, self.width, True, dtype), nn.GELU(), Linear(self.width, out_size, True, dtype)
        )

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(h).view(-1, self.width))


class Qwen2_5VisionTransformer(nn.Module):
    """Parameters named as the checkpoint's under `visual.`."""

    def __init__(self, config: Any, dtype: torch.dtype):
        super().__init__()
        self.merge = config.spatial_merge_size
        self.window = config.window_size // config.spatial_merge_size // config.patch_size
        self.full_attention = set(config.fullatt_block_indexes)
        self.config = config
        self.patch_embed = VisionPatchEmbed(config, dtype)
        self.blocks = nn.ModuleList(VisionBlock(config, dtype) for _ in range(config.depth))
        self.merger = PatchMerger(config.hidden_size, config.out_hidden_size, self.merge, dtype)

    def forward(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """All images' patches [sum(t*h*w), C*T*P*P] -> their tokens [sum(t*h*w) / merge^2, out_hidden]."""
        unit = self.merge * self.merge
        order, windows, frames = window_order(grids, self.merge, self.window)
        order = order.to(pixels.device)

        def in_window_order(x: torch.Tensor) -> torch.Tensor:
            return x.view(-1, unit, x.shape[-1])[order].view(-1, x.shape[-1])

        h = in_window_order(self.patch_embed(pixels))
        cos, sin = (in_window_order(x) for x in grid_rotary(self.config, grids, self.merge, pixels.device))
        for i, block in enumerate(self.blocks):
            h = block(h, cos, sin, frames if i in self.full_attention else windows)
        return self.merger(h)[torch.argsort(order)]
