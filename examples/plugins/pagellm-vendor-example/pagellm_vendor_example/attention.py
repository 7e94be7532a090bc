"""`VENDOR_ATTN`: paged attention as a vendor would write it for their device, here in plain torch.

The KV cache keeps a block's keys and values side by side, [num_blocks, 2, block_size, kv_heads, head_size],
so one block is one contiguous transfer. Each request's context is gathered through its block table and
attended with an explicit causal softmax in float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagellm.core.attention import AttentionBackend, AttentionBatch, AttentionSpec
from pagellm.core.platform import Platform

from .platform import VendorSimPlatform


@dataclass
class VendorAttentionMetadata:
    """Per-step plan shared by every layer: the host-side request bounds, read once instead of per layer."""

    slot_mapping: torch.Tensor  # [num_tokens]
    requests: list[tuple[int, int, int, torch.Tensor]]  # (query start, query end, seq len, block table row)


class VendorAttentionBackend(AttentionBackend):
    name = "VENDOR_ATTN"
    device_types = ("cpu",)
    dtypes = (torch.float32, torch.bfloat16)
    block_sizes = (16, 32)
    supports_sliding_window = False

    @classmethod
    def unsupported_reasons(cls, spec: AttentionSpec, platform: type[Platform]) -> list[str]:
        """The kernels need the vendor's device; the host CPU platform has the same torch device type."""
        reasons = super().unsupported_reasons(spec, platform)
        if platform.name != VendorSimPlatform.name:
            reasons.append(f"needs the {VendorSimPlatform.name} device, not {platform.name}")
        return reasons

    @classmethod
    def kv_cache_shape(cls, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple:
        return (num_blocks, 2, block_size, num_kv_heads, head_size)

    @classmethod
    def build_metadata(cls, batch: AttentionBatch) -> VendorAttentionMetadata:
        starts = batch.query_start_loc_cpu.tolist()
        seq_lens = batch.seq_lens_cpu.tolist()
        requests = [
            (starts[i], starts[i + 1], seq_lens[i], batch.block_tables[i])
            for i in range(len(seq_lens))
            if starts[i + 1] > starts[i]
        ]
        return VendorAttentionMetadata(batch.slot_mapping, requests)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: VendorAttentionMetadata,
    ) -> torch.Tensor:
        self._store(k, v, kv_cache, metadata.slot_mapping)
        out = torch.empty_like(q)
        for start, end, seq_len, blocks in metadata.requests:
            out[start:end] = self._attend(q[start:end], kv_cache, blocks, seq_len)
        return out

    @staticmethod
    def _store(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        block_size = kv_cache.shape[2]
        keep = slot_mapping >= 0
        slots = slot_mapping[keep]
        blocks, offsets = slots // block_size, slots % block_size
        kv_cache[blocks, 0, offsets] = k[keep].to(kv_cache.dtype)
        kv_cache[blocks, 1, offsets] = v[keep].to(kv_cache.dtype)

    def _attend(
        self, q: torch.Tensor, kv_cache: torch.Tensor, blocks: torch.Tensor, seq_len: int
    ) -> torch.Tensor:
        """Causal attention of one request's query tokens (the last ones of its sequence) to its context."""
        block_size = kv_cache.shape[2]
        used = blocks[: (seq_len + block_size - 1) // block_size].long()
        context = kv_cache[used].transpose(0, 1).flatten(1, 2)[:, :seq_len]  # [2, seq_len, kv_heads, head]
        keys, values = context[0].float(), context[1].float()
        group = self.spec.num_heads // self.spec.num_kv_heads
        if group > 1:
            keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q.float(), keys) * self.spec.softmax_scale
        query_pos = torch.arange(seq_len - q.shape[0], seq_len, device=q.device)
        key_pos = torch.arange(seq_len, device=q.device)
        scores.masked_fill_(key_pos[None, None, :] > query_pos[None, :, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        return torch.einsum("hqk,khd->qhd", probs, values).to(q.dtype)
