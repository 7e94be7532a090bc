"""FLEX_ATTENTION: paged attention with torch's `flex_attention` and block masks, on CPU, CUDA and XPU.

The step is planned exactly as TORCH_SDPA plans it (the same gather of each request's visible context
through its block table, the same decode batch), and each attention call runs `flex_attention` with a
`BlockMask` built from that plan's causal and sliding-window visibility, so fully hidden tiles are
skipped where flex_attention is compiled (a step's bidirectional spans, image tokens that attend both ways, are
in those masks). Block masks are built once per step and shared by all layers.
Logit soft-capping is a `score_mod`; sink logits rescale the output by the log-sum-exp flex_attention
returns (out * sigmoid(lse - sink)). On accelerators flex_attention is compiled (its fused kernels), once
per variant (`CompiledFlex`), and each compile is logged with what it cost; on CPU it runs eagerly, which
materialises the scores: correct everywhere, rarely the fastest there.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import logging
import re
import time
import types
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

from pagellm.attention_backends._base import scale_by_sinks
from pagellm.attention_backends.torch_sdpa import TorchSDPABackend, TorchSDPAMetadata
from pagellm.core.attention import AttentionBackend, AttentionSpec
from pagellm.core.platform import Platform
from pagellm.plugins import hookimpl

PAGELLM_PLUGIN_API = "1.0"

logger = logging.getLogger("pagellm")

FLEX_MODULE = "torch.nn.attention.flex_attention"

RECOMPILE_LIMIT = 64
"""Graphs one compiled variant may keep (Dynamo's default, shared by all callers, is 8)."""


@dataclass
class FlexMetadata(TorchSDPAMetadata):
    block_masks: dict[Any, tuple[torch.Tensor | None, Any]] = field(default_factory=dict)
    """Per step, by mask: (the dense mask, kept alive so its id stays unique; its BlockMask)."""


class FlexAttentionBackend(TorchSDPABackend):
    name = "FLEX_ATTENTION"
    version = "2"  # compiled once per variant
    device_types = ("cpu", "cuda", "xpu")
    supports_sliding_window = True  # the block mask
    supports_logits_soft_cap = True  # a score_mod
    supports_sinks = True  # the output rescaled by the returned log-sum-exp
    supports_bidirectional_spans = True  # the plan's dense masks
    supports_attention_chunk = True  # the plan's dense masks
    # not the latent layout: the step's block masks, shared by its layers, assume each layer's decodes
    # group the query heads alike, and a latent layer's one KV head groups them all
    supports_latent_kv = False
    metadata_type = FlexMetadata
    not_in_compiled_graphs = (
        "its block masks come from torch.vmap over the mask function, which fails inside the ahead-of-time "
        "compiled forward's call of the attention op (torch: NYI: querying is_contiguous inside of vmap)"
    )

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
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        self._block_masks = metadata.block_masks
        return super().forward(q, k, v, kv_cache, metadata, sinks)

    def _attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | None,
        sinks: torch.Tensor | None,
    ) -> torch.Tensor:
        """q: [..., H, Q, d], k/v: [..., KV, C, d] (3-d for a prefill, 4-d for the decode batch); mask
        [Q, C] or [B, 1, 1, C], True = attend; None means causal with Q == C; sinks broadcastable to
        [..., H, Q], or None."""
        squeeze = q.dim() == 3
        if squeeze:
            q, k, v = q[None], k[None], v[None]
        cap = self.spec.logits_soft_cap
        lse = self.spec.has_sinks  # the same variant with and without the tensor (timing passes none)
        gqa = q.shape[-3] != k.shape[-3]
        kind = "causal" if mask is None else ("prefill" if mask.dim() == 2 else "decode")
        if _compiles(q.device.type):
            flex = _compiled_flex(q.device.type, q.dtype, q.shape[-1], kind, cap, gqa, lse)
        else:
            flex = _eager
        out = flex(
            q,
            k,
            v,
            score_mod=None if cap is None else _soft_cap_mod(cap, q.device),
            block_mask=self._block_mask(mask, q.shape[0], q.shape[-2], k.shape[-2], q.device),
            scale=self.spec.softmax_scale,
            enable_gqa=gqa,
            **(_lse_request() if lse else {}),
        )
        if lse:
            out, aux = out
            if sinks is not None:
                out = scale_by_sinks(out, getattr(aux, "lse", aux), sinks)
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


@functools.cache
def _lse_request() -> dict[str, Any]:
    """flex_attention's arguments that make it return the log-sum-exp too: `return_aux=AuxRequest(lse=True)`
    from torch 2.9 (which deprecates `return_lse`), `return_lse=True` before."""
    from torch.nn.attention import flex_attention as flex

    if "return_aux" in inspect.signature(flex.flex_attention).parameters:
        return {"return_aux": flex.AuxRequest(lse=True)}
    return {"return_lse": True}


def _soft_cap(score: torch.Tensor, b, h, q_idx, kv_idx, cap: torch.Tensor) -> torch.Tensor:
    return cap * torch.tanh(score / cap)


@functools.cache
def _soft_cap_mod(cap: float, device: torch.device):
    """The soft-cap `score_mod`, one object per cap and device, with the cap as a 0-d tensor: compiled with
    dynamic=True, a Python float would reach flex_attention as a symbolic float, which it refuses."""
    return functools.partial(_soft_cap, cap=torch.tensor(cap, device=device))


def _compiles(device_type: str) -> bool:
    """Whether flex_attention is compiled on this device type: on accelerators, not on CPU, where compiling
    it costs more than it saves."""
    return device_type != "cpu"


def _eager(*args, **kwargs) -> torch.Tensor:
    """flex_attention uncompiled, without its warning about materialised scores (expected here)."""
    from torch.nn.attention.flex_attention import flex_attention

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        return flex_attention(*args, **kwargs)


def _call_flex(*args, **kwargs) -> torch.Tensor:
    """The function each variant compiles, through its own copy of this code object."""
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention(*args, **kwargs)


class CompiledFlex:
    """flex_attention compiled for one variant: device type, dtype, head size, mask kind, soft-cap, GQA,
    log-sum-exp returned (sinks).

    Dynamo keeps compiled graphs, and counts recompiles against `recompile_limit` (8), per code object: one
    compiled flex_attention shared by every variant fell back to eager after the eighth graph. Each variant
    here compiles its own copy of `_call_flex`'s code, named after the variant (Dynamo's logs show it), so
    variants never evict one another. Within a variant `dynamic=True` keeps size changes in one graph, as
    long as Dynamo neither specialises sizes of 0 and 1 nor unites sizes that happened to be equal on the
    first call (`_one_graph_for_all_sizes`): on an H200 a decode variant first traced at batch 1 compiled
    four more times (5-8 s each) over its first dozen steps. Should a size-oblivious trace fail, the variant
    traces with Dynamo's defaults (a graph per 0/1 pattern) under `RECOMPILE_LIMIT` rather than 8. The
    first call compiles and is timed in the log. Should compiling fail or a limit be hit anyway
    (`fullgraph=True` makes that an error, not a silent fallback), the variant warns once and runs eagerly
    from then on.
    """

    compiled_count = 0
    compile_seconds = 0.0
    """Variants compiled in this process and the seconds their first calls took, for the log."""

    def __init__(self, name: str):
        self.name = name
        code = _call_flex.__code__.replace(co_name="flex_attention_" + re.sub(r"\W", "_", name))
        entry = types.FunctionType(code, _call_flex.__globals__, code.co_name)
        self._compiled = torch.compile(entry, dynamic=True, fullgraph=True)
        self._warm = False
        self._size_oblivious = True

    def __call__(self, *args, **kwargs) -> torch.Tensor:
        if self._compiled is None:
            return _eager(*args, **kwargs)
        start = time.perf_counter()
        try:
            with _recompile_limit(), _one_graph_for_all_sizes(self._size_oblivious):
                out = self._compiled(*args, **kwargs)
        except _compile_errors() as exc:
            if self._size_oblivious:
                logger.info(
                    "FLEX_ATTENTION: flex_attention for %s traced for all sizes failed (%s: %s); traced "
                    "again with sizes 0 and 1 specialised",
                    self.name,
                    type(exc).__name__,
                    next(iter(str(exc).splitlines()), ""),
                )
                self._size_oblivious = False
                return self(*args, **kwargs)
            logger.warning(
                "FLEX_ATTENTION: flex_attention for %s could not be compiled and runs eagerly from now on "
                "(slower: it materialises the scores): %s: %s",
                self.name,
                type(exc).__name__,
                next(iter(str(exc).splitlines()), ""),
            )
            self._compiled = None
            return _eager(*args, **kwargs)
        if not self._warm:
            self._warm = True
            seconds = time.perf_counter() - start
            CompiledFlex.compiled_count += 1
            CompiledFlex.compile_seconds += seconds
            logger.info(
                "FLEX_ATTENTION: compiled flex_attention for %s in %.1f s (%d variants, %.1f s in all)",
                self.name,
                seconds,
                CompiledFlex.compiled_count,
                CompiledFlex.compile_seconds,
            )
        return out


@functools.cache
def _compiled_flex(
    device_type: str,
    dtype: torch.dtype,
    head_size: int,
    kind: str,
    cap: float | None,
    gqa: bool,
    lse: bool = False,
) -> CompiledFlex:
    """The compiled variant for these facts, made on first use and kept for the process."""
    name = f"{device_type} {str(dtype).removeprefix('torch.')} d{head_size} {kind}"
    name += (
        (f" softcap{cap:g}" if cap is not None else "") + (" gqa" if gqa else "") + (" lse" if lse else "")
    )
    return CompiledFlex(name)


def _recompile_limit():
    """Dynamo's per-code-object recompile limit raised to RECOMPILE_LIMIT for one call (older torch names
    the setting `cache_size_limit`)."""
    from torch._dynamo import config

    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    return config.patch(**{name: RECOMPILE_LIMIT})


def _one_graph_for_all_sizes(on: bool):
    """Dynamo's shape settings for one call: with `on`, sizes of 0 and 1 are reasoned about like any other
    (`backed_size_oblivious`) and sizes equal by chance are not made one symbol (`use_duck_shape`), so a
    batch of one, a one-token query or a one-block mask does not pin the graph it is traced with. Settings
    this torch lacks are left out."""
    from torch.fx.experimental import _config as shapes

    wanted = {"backed_size_oblivious": True, "use_duck_shape": False} if on else {}
    return shapes.patch(**{name: value for name, value in wanted.items() if hasattr(shapes, name)})


def _compile_errors() -> tuple[type[BaseException], ...]:
    """What a failed compile raises: Dynamo's errors, and the recompile limit under fullgraph (a class of
    its own in recent torch, a Dynamo error in older)."""
    from torch._dynamo import exc

    errors: tuple[type[BaseException], ...] = (exc.TorchDynamoException,)
    if hasattr(exc, "FailOnRecompileLimitHit"):
        errors += (exc.FailOnRecompileLimitHit,)
    return errors


@hookimpl
def pagellm_attention_backends() -> list[type[AttentionBackend]]:
    return [FlexAttentionBackend]
