"""FLEX_ATTENTION: paged attention with torch's `flex_attention` and block masks, on CPU, CUDA and XPU.

The step is planned exactly as TORCH_SDPA plans it (the same gather of each request's visible context
through its block table, the same decode batch), and each attention call runs `flex_attention` with a
`BlockMask` built from that plan's causal and sliding-window visibility, so fully hidden tiles are
skipped where flex_attention is compiled. Block masks are built once per step and shared by all layers.
Logit soft-capping is a `score_mod`. On accelerators flex_attention is compiled (its fused kernels); on
CPU it runs eagerly, which materialises the scores: correct everywhere, rarely the fastest there.
"""

from __future__ import annotations

import functools
import importlib.util
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

from pagellm.attention_backends.torch_sdpa import TorchSDPABackend, TorchSDPAMetadata
from pagellm.core.attention import AttentionBackend, AttentionSpec
from pagellm.core.platform import Platform
from pagellm.plugins import hookimpl

PAGELLM_PLUGIN_API = "1.0"

FLEX_MODULE = "torch.nn.attention.flex_attention"


@dataclass
class FlexMetadata(TorchSDPAMetadata):
    block_masks: dict[Any, tuple[torch.Tensor | None, Any]] = field(default_factory=dict)
    """Per step, by mask: (the dense mask, kept alive so its id stays unique; its BlockMask)."""


class FlexAttentionBackend(TorchSDPABackend):
    name = "FLEX_ATTENTION"
    device_types = ("cpu", "cuda", "xpu")
    metadata_type = FlexMetadata

    @classmethod
    def unsupported_reasons(cls, spec: AttentionSpec, platform: type[Platform]) -> list[str]:
        reasons = super().unsupported_reasons(spec, platform)
        if importlib.util.find_spec(FLEX_MODULE) is None:
            reasons.append(f"torch {torch.__version__} has no flex_attention (needs torch >= 2.5)")
        return reasons

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: FlexMetadata,
    ) -> torch.Tensor:
        self._block_masks = metadata.block_masks
        return super().forward(q, k, v, kv_cache, metadata)

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        """q: [..., H, Q, d], k/v: [..., KV, C, d] (3-d for a prefill, 4-d for the decode batch); mask
        [Q, C] or [B, 1, 1, C], True = attend; None means causal with Q == C."""
        squeeze = q.dim() == 3
        if squeeze:
            q, k, v = q[None], k[None], v[None]
        cap = self.spec.logits_soft_cap
        out = _flex(q.device.type)(
            q,
            k,
            v,
            score_mod=None if cap is None else functools.partial(_soft_cap, cap=cap),
            block_mask=self._block_mask(mask, q.shape[0], q.shape[-2], k.shape[-2], q.device),
            scale=self.spec.softmax_scale,
            enable_gqa=q.shape[-3] != k.shape[-3],
        )
        return out[0] if squeeze else out

    def _block_mask(
        self, mask: torch.Tensor | None, batch: int, q_len: int, kv_len: int, device: torch.device
    ) -> Any:
        from torch.nn.attention.flex_attention import create_block_mask

        key = ("causal", q_len) if mask is None else id(mask)
        if key not in self._block_masks:
            if mask is None:

                def mask_mod(b, h, q_idx, kv_idx):
                    return q_idx >= kv_idx

            elif mask.dim() == 2:

                def mask_mod(b, h, q_idx, kv_idx):
                    return mask[q_idx, kv_idx]

            else:

                def mask_mod(b, h, q_idx, kv_idx):
                    return mask[b, 0, 0, kv_idx]

            rows = None if mask is None or mask.dim() == 2 else batch
            block_mask = create_block_mask(mask_mod, rows, None, q_len, kv_len, device=device)
            self._block_masks[key] = (mask, block_mask)
        return self._block_masks[key][1]


def _soft_cap(score: torch.Tensor, b, h, q_idx, kv_idx, cap: float) -> torch.Tensor:
    return cap * torch.tanh(score / cap)


@functools.cache
def _flex(device_type: str):
    """flex_attention compiled for accelerators; eager on CPU, where compiling it costs more than it saves
    and the eager path's warning about materialised scores is expected."""
    from torch.nn.attention.flex_attention import flex_attention

    if device_type != "cpu":
        return torch.compile(flex_attention, dynamic=True)

    def eager(*args, **kwargs):
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
            return flex_attention(*args, **kwargs)

    return eager


@hookimpl
def pagellm_attention_backends() -> list[type[AttentionBackend]]:
    return [FlexAttentionBackend]
