"""FLASH_ATTN: FlashAttention 2's `flash_attn_varlen_func` reading the paged KV cache through block tables.

One call covers the mixed batch: flash-attn's causal mask is aligned to the end of each sequence, which is
exactly "the query tokens are the last ones of the sequence", so prefill chunks over cached context and
decodes need nothing but the cumulative sequence lengths. The new K/V are stored with `index_copy_` first.

flash-attn is optional: nothing here imports it until `forward`, and `unsupported_reasons` says when it is
missing or cannot run the model. Its CUDA kernels need compute capability 8.x or 9.0, fp16 or bf16 for
both compute and cache, head sizes up to 256 that are multiples of 8, and a paged cache whose blocks are a
multiple of 256 tokens (the check in its `mha_varlen_fwd`): its `preferred_block_size` is 256, which the
selector gives it when the user sets no --block-size; an explicit smaller one rules it out.
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass, field

import torch

from pagellm.attention_backends._base import PagedBackend, PagedMetadata, store_kv
from pagellm.core.attention import AttentionBackend, AttentionSpec
from pagellm.core.platform import Platform
from pagellm.plugins import hookimpl

PAGELLM_PLUGIN_API = "1.0"

MIN_VERSION = (2, 6)
"""First flash-attn release with both `block_table` and `softcap` in `flash_attn_varlen_func`."""
PAGE_MULTIPLE = 256
"""flash-attn 2 refuses paged caches whose block size is not a multiple of this."""
CAPABILITIES = ((8, 0), (9, 0))
"""Compute capabilities its kernels are built for: [8.0, 9.0]; it refuses newer and older devices."""


def installed_version() -> tuple[int, ...] | None:
    """flash-attn's version from the package metadata (cheap: does not load its CUDA extension)."""
    try:
        text = importlib.metadata.version("flash-attn")
    except importlib.metadata.PackageNotFoundError:
        return None
    return tuple(int(p) for p in text.split("+")[0].split(".")[:3] if p.isdigit())


@dataclass
class FlashAttnMetadata(PagedMetadata):
    cu_seqlens_k: torch.Tensor = field(init=False)  # int32 [num_reqs + 1]: cumulative context lengths

    def __post_init__(self) -> None:
        seq_lens = self.batch.seq_lens
        self.cu_seqlens_k = torch.zeros(seq_lens.shape[0] + 1, dtype=torch.int32, device=seq_lens.device)
        torch.cumsum(seq_lens, 0, out=self.cu_seqlens_k[1:])


class FlashAttnBackend(PagedBackend):
    name = "FLASH_ATTN"
    device_types = ("cuda",)
    dtypes = (torch.float16, torch.bfloat16)
    supports_sliding_window = True  # window_size=(window - 1, 0)
    supports_logits_soft_cap = True  # softcap=, since 2.6
    supports_sinks = False  # flash-attn 2's flash_attn_varlen_func has no sink logits (not checked: FA3's)
    metadata_type = FlashAttnMetadata
    cuda_graph_decode = True

    @classmethod
    def preferred_block_size(cls) -> int:
        return PAGE_MULTIPLE

    @classmethod
    def unsupported_reasons(cls, spec: AttentionSpec, platform: type[Platform]) -> list[str]:
        reasons = super().unsupported_reasons(spec, platform)
        version = installed_version()
        if version is None:
            reasons.append("the flash-attn package is not installed (pip install flash-attn)")
        elif version[:2] < MIN_VERSION:
            found, wanted = ".".join(map(str, version)), ".".join(map(str, MIN_VERSION))
            reasons.append(
                f"flash-attn {found} is too old: paged KV in flash_attn_varlen_func needs {wanted}+"
            )
        if platform.name == "rocm":
            reasons.append("flash-attn's ROCm build has other limits and is not wired up here")
        elif platform.device_type == "cuda":
            capability = platform.device_capability()
            if capability is None or not CAPABILITIES[0] <= capability <= CAPABILITIES[1]:
                shown = "unknown" if capability is None else ".".join(map(str, capability))
                reasons.append(f"compute capability {shown}; flash-attn 2 runs on 8.x and 9.0")
        if spec.cache_dtype != spec.dtype:
            reasons.append("the KV cache must have the compute dtype")
        if spec.head_size > 256 or spec.head_size % 8:
            reasons.append(f"head size {spec.head_size}: needs a multiple of 8, at most 256")
        if spec.block_size % PAGE_MULTIPLE:
            reasons.append(
                f"block size {spec.block_size}: flash-attn reads a paged cache only in blocks of a multiple of "
                f"{PAGE_MULTIPLE} tokens (--block-size {PAGE_MULTIPLE})"
            )
        return reasons

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: FlashAttnMetadata,
    ) -> torch.Tensor:
        from flash_attn import flash_attn_varlen_func

        s = self.spec
        store_kv(kv_cache, k, v, metadata)
        batch = metadata.batch
        return flash_attn_varlen_func(
            q,
            kv_cache[0],  # [num_blocks, block_size, kv_heads, head_size]
            kv_cache[1],
            cu_seqlens_q=batch.query_start_loc,
            cu_seqlens_k=metadata.cu_seqlens_k,
            max_seqlen_q=batch.max_query_len,
            max_seqlen_k=batch.max_seq_len,
            softmax_scale=s.softmax_scale,
            causal=True,
            window_size=(-1, -1) if s.sliding_window is None else (s.sliding_window - 1, 0),
            softcap=s.logits_soft_cap or 0.0,
            block_table=batch.block_tables,
        )


@hookimpl
def pagellm_attention_backends() -> list[type[AttentionBackend]]:
    return [FlashAttnBackend]
