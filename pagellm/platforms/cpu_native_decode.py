"""The CPU platform's native decode step (`Platform.native_decode_step`): a decode step through a dense Llama
decoder in one call of `cpu_kernels/native_decoder.cpp`, one request's token, or a batch's tokens where every
linear is on the pair kernel (the batch's rows multiplied as `cpu_bf16_pair_linear` multiplies them).

It applies where every piece of the step has a kernel that call can run: the decoder's linears either GGUF
blocks on the GGUF kernels (`QuantMethod.native_blocks`; any CPU the kernels build for) or bfloat16 packed
for the pair kernel (a CPU with AVX-512 BF16 and no AMX: AMD Zen 4 and 5) or the panel kernel (AVX2-only
CPUs: AMD Zen 2 and 3, older Intel), the token embedding bfloat16 or GGUF rows,
bfloat16 activations and KV cache read by CPU_ATTN's kernel, a SiLU-gated MLP or routed experts on the
GGUF or fused-MoE kernel (Qwen3-MoE: softmax routing, no bias), attention without a sliding
window, soft cap, sinks or batch invariance. Anything else keeps the model's forward, and start-up says
which part stopped it. An EAGLE-3 head's pass (`native_head_step`) runs its one layer the same way, on the
same terms.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from pagellm.attention_backends.cpu_attn import KERNEL_ITEMS_PER_THREAD, MIN_PARTITION, CpuAttnBackend
from pagellm.core.native_decode import DenseDecoder, DenseLayer, DraftHead, Experts, HeadRows, Projection
from pagellm.platforms import cpu_kernels, cpu_linear
from pagellm.platforms.cpu_gguf_moe import GgufExperts
from pagellm.platforms.cpu_moe import CpuFusedMoE

ANY_ROWS = 2**63 - 1
"""`native_decoder_max_rows` of a plan with no GGUF projection: a step of any batch."""


class CpuNativeDecodeStep:
    """A plan handed to the kernels once (weights, caches, sizes); each call one decode step of up to
    `max_rows` rows (any number, four where some projections are GGUF blocks): a row per request, or a
    request's token and the drafts after it to verify."""

    def __init__(self, kernels: Any, handle: int, hidden_size: int):
        self._kernels = kernels
        self._handle = handle
        self._hidden_size = hidden_size
        self.max_rows = int(kernels.native_decoder_max_rows(handle))
        self.aux_layers: tuple[int, ...] = ()
        self.aux: torch.Tensor | None = None
        weakref.finalize(self, kernels.native_decoder_drop, handle)

    def __call__(
        self, tokens: np.ndarray, positions: np.ndarray, slots: np.ndarray, block_tables: np.ndarray
    ) -> torch.Tensor:
        rows = len(tokens)
        out = torch.empty(rows, self._hidden_size, dtype=torch.bfloat16)
        aux = torch.empty(len(self.aux_layers), rows, self._hidden_size, dtype=torch.bfloat16)
        self._kernels.native_decoder_step(
            self._handle,
            out,
            _int64(tokens),
            _int64(positions),
            _int64(slots),
            torch.from_numpy(np.ascontiguousarray(block_tables, dtype=np.int32)),
            torch.tensor(self.aux_layers, dtype=torch.int64),
            aux,
        )
        self.aux = aux.transpose(0, 1).reshape(rows, -1) if self.aux_layers else None
        return out


def _int64(values: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.int64))


def native_decode_step(
    model: DenseDecoder, kv_caches: list[torch.Tensor], attention: list[Any], block_size: int
) -> tuple[CpuNativeDecodeStep | None, str]:
    kernels = cpu_kernels.loaded()
    if kernels is None:
        return None, "the CPU kernels are not loaded here"
    why = _unsupported(model, kv_caches, attention)
    if why is not None:
        return None, why
    norms, parts, part_types, part_counts, biases, head_norms = [], [], [], [], [], []
    moe, experts, expert_types = [], [], []
    for layer in model.layers:
        norms += [layer.input_norm, layer.post_attention_norm]
        for p in _projections(layer, with_empty=True):
            blocks = [] if p is None else p.blocks if p.blocks is not None else [(p.weight, _layout(p))]
            parts += [tensor for tensor, _ in blocks]
            part_types += [type_id for _, type_id in blocks]
            part_counts.append(len(blocks))
            biases.append(None if p is None else p.bias)
        head_norms += [layer.q_norm, layer.k_norm]
        tensors, types, sizes = _experts(layer.experts)
        moe += sizes
        experts += tensors
        expert_types += types
    spec = attention[0].impl.spec
    dims = [
        model.hidden_size,
        model.num_heads,
        model.num_kv_heads,
        model.head_size,
        model.intermediate_size,
        block_size,
        KERNEL_ITEMS_PER_THREAD,
        MIN_PARTITION,
    ]
    floats = [model.eps, model.rope_scaling, spec.softmax_scale]
    handle = kernels.native_decoder_plan(
        model.embedding,
        -1 if model.embedding_type is None else model.embedding_type,
        model.final_norm,
        model.inv_freq.float(),
        norms,
        parts,
        part_types,
        part_counts,
        biases,
        head_norms,
        kv_caches,
        moe,
        experts,
        expert_types,
        dims,
        floats,
        attention[0].impl.use_amx,
    )
    step = CpuNativeDecodeStep(kernels, handle, model.hidden_size)
    if step.max_rows == ANY_ROWS:
        return step, "one call per decode step, of one request or a batch"
    return step, (
        f"one call per decode step of up to {step.max_rows} rows (requests, or one request's drafts to "
        "verify); a larger batch's runs the forward (GGUF linears: their tiles)"
    )


class CpuNativeHeadStep:
    """An EAGLE-3 head's plan handed to the kernels once; each call one pass over up to `max_rows` rows."""

    def __init__(self, kernels: Any, handle: int, hidden_size: int):
        self._kernels = kernels
        self._handle = handle
        self._hidden_size = hidden_size
        self.max_rows = int(kernels.native_decoder_max_rows(handle))
        weakref.finalize(self, kernels.native_decoder_drop, handle)

    def __call__(self, rows: HeadRows) -> tuple[torch.Tensor, torch.Tensor]:
        hidden_out = torch.empty(len(rows.picks), self._hidden_size, dtype=torch.bfloat16)
        drafts = torch.empty(len(rows.picks), dtype=torch.int64)
        self._kernels.native_head_step(
            self._handle,
            _int64(rows.tokens),
            _int64(rows.positions),
            _int64(rows.slots),
            torch.from_numpy(np.ascontiguousarray(rows.block_tables, dtype=np.int32)),
            rows.hidden.contiguous(),
            _int64(rows.picks),
            hidden_out,
            drafts,
        )
        return drafts, hidden_out


def native_head_step(
    head: DraftHead, kv_cache: torch.Tensor, attention: Any, block_size: int
) -> tuple[CpuNativeHeadStep | None, str]:
    kernels = cpu_kernels.loaded()
    if kernels is None:
        return None, "the CPU kernels are not loaded here"
    why = _unsupported(head, [kv_cache], [attention], [head.layer], [head.lm_head])
    if why is not None:
        return None, why
    layer = head.layer
    parts, part_types, part_counts = [], [], []
    for p in [*_projections(layer), head.lm_head]:
        blocks = p.blocks if p.blocks is not None else [(p.weight, _layout(p))]
        parts += [tensor for tensor, _ in blocks]
        part_types += [type_id for _, type_id in blocks]
        part_counts.append(len(blocks))
    dims = [
        head.hidden_size,
        head.num_heads,
        head.num_kv_heads,
        head.head_size,
        head.intermediate_size,
        block_size,
        KERNEL_ITEMS_PER_THREAD,
        MIN_PARTITION,
    ]
    handle = kernels.native_head_plan(
        head.embedding,
        -1 if head.embedding_type is None else head.embedding_type,
        head.final_norm,
        head.inv_freq.float(),
        [layer.input_norm, head.hidden_norm, layer.post_attention_norm],
        parts,
        part_types,
        part_counts,
        [p.bias for p in [*_projections(layer), head.lm_head]],
        kv_cache,
        head.d2t.to(torch.int64).contiguous(),
        dims,
        [head.eps, head.rope_scaling, attention.impl.spec.softmax_scale],
        attention.impl.use_amx,
        head.norm_before_residual,
    )
    step = CpuNativeHeadStep(kernels, handle, head.hidden_size)
    rows = "any number of rows" if step.max_rows == ANY_ROWS else f"up to {step.max_rows} rows"
    return step, f"one call per pass of {rows}"


def _unsupported(
    model: DenseDecoder | DraftHead,
    kv_caches: list[torch.Tensor],
    attention: list[Any],
    layers: Sequence[DenseLayer] | None = None,
    extra: Sequence[Projection] = (),
) -> str | None:
    """Why the kernel cannot run this model's step (or this head's pass: its `layers` and `extra`
    projections), or None."""
    layers = model.layers if layers is None else layers
    if model.activation != "silu":
        return f"its MLP's activation is {model.activation}, not silu"
    if model.dtype != torch.bfloat16 or model.final_norm.dtype != torch.bfloat16:
        return f"the model's dtype is {model.dtype}, not bfloat16"
    if model.embedding_type is None and model.embedding.dtype != torch.bfloat16:
        return "its token embedding is neither bfloat16 nor GGUF blocks"
    projections: list[Projection] = [p for layer in layers for p in _projections(layer)] + list(extra)
    if not all(p.blocks is not None or _layout(p) is not None for p in projections):
        return (
            "its bfloat16 linears are on neither the pair kernel (AVX-512 BF16) nor the panel kernel (AVX2)"
        )
    if any(
        p.blocks is not None and p.bias is not None and p.bias.dtype != torch.bfloat16 for p in projections
    ):
        return "a GGUF linear's bias is not bfloat16"
    why = next(filter(None, (_experts_unsupported(layer.experts) for layer in layers)), None)
    if why is not None:
        return why
    if len(attention) != len(layers) or len(kv_caches) != len(layers):
        return "its attention layers and KV caches do not match its decoder layers"
    scales = set()
    for layer, cache in zip(attention, kv_caches, strict=True):
        impl, spec = layer.impl, layer.impl.spec
        if not isinstance(impl, CpuAttnBackend) or impl.kernel is None:
            return "its attention is not on CPU_ATTN's kernel"
        if cache.dtype != torch.bfloat16 or cache.dim() != 5:
            return "its KV cache is not bfloat16 in CPU_ATTN's layout"
        if spec.sliding_window or spec.logits_soft_cap or spec.has_sinks or spec.batch_invariant:
            return "its attention has a sliding window, a soft cap, sinks or batch invariance"
        if spec.attention_chunk:
            return "its attention is chunked"
        scales.add(spec.softmax_scale)
    if len(scales) != 1:
        return "its layers' attention scales differ"
    return None


def _experts_unsupported(experts: Experts | None) -> str | None:
    """Why the step cannot run these experts (it calls the GGUF or the fused-MoE kernel: SiLU, no biases,
    bfloat16 experts on the latter), or None."""
    kernel = experts.kernel if experts is not None else None
    if kernel is None:
        return None
    if isinstance(kernel, GgufExperts):
        plain = kernel.activation == "silu" and all(b is None for b in kernel.biases)
    elif isinstance(kernel, CpuFusedMoE):
        plain = kernel.activation == "silu" and kernel.w13_scale is None and kernel.w13_bias is None
    else:
        return "its experts are on neither the GGUF nor the fused-MoE kernel"
    return None if plain else "its experts have biases, scales or another activation than silu"


PAIRS, PANELS = -1, -2
"""The native step's codes for a pair-packed and a panel-packed bfloat16 projection (GGML types are >= 0)."""


def _layout(p: Projection) -> int | None:
    """A bfloat16 projection's layout code where the native step multiplies it (the pair kernel, or the
    panel kernel in the order of any batch, without a scale), else None."""
    if isinstance(p.matmul, cpu_linear.PairLinear):
        return PAIRS
    plain_panels = isinstance(p.matmul, cpu_linear.PanelLinear) and not p.matmul.fixed_order
    if plain_panels and p.weight.dtype == torch.bfloat16 and cpu_kernels.loaded().native_decoder_panels():
        return PANELS
    return None


def _projections(layer: DenseLayer, with_empty: bool = False) -> list[Projection | None]:
    """qkv, o, then gate_up and down, or for an expert layer the router (and None with `with_empty`)."""
    if layer.experts is None:
        return [layer.qkv, layer.o, layer.gate_up, layer.down]
    return [layer.qkv, layer.o, layer.experts.router] + ([None] if with_empty else [])


def _experts(experts: Experts | None) -> tuple[list[torch.Tensor | None], list[int], list[int]]:
    """An expert layer's kernel as the native step takes it: its tensors (GGUF: gate, up, down; the fused
    kernel's w13 and w2, then None), their GGML types (-1 for the fused kernel's) and (top k, renormalize,
    experts); a dense layer's Nones and zeros."""
    if experts is None:
        return [None, None, None], [-1, -1, -1], [0, 0, 0]
    kernel, sizes = experts.kernel, [experts.top_k, int(experts.renormalize), experts.router.out_features]
    if isinstance(kernel, GgufExperts):
        return list(kernel.blocks), list(kernel.types), sizes
    return [kernel.w13, kernel.w2, None], [-1, -1, -1], sizes
