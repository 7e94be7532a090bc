"""The host CPU: always available; the KV cache takes `--kv-cache-space` GiB of RAM."""

from __future__ import annotations

import functools
import logging
import os
import platform as pyplatform
import shutil
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from pagellm.core.dtypes import dtype_name
from pagellm.core.errors import ConfigError
from pagellm.core.moe import Mxfp4Experts, PackedMoE
from pagellm.core.platform import DTYPE_VIEWS, FLOAT8, Availability, GiB, PackedLinear, Platform
from pagellm.core.sparse_kernels import SparseAttentionKernels
from pagellm.core.state import RecurrentKernels
from pagellm.platforms import cpu_gguf_moe, cpu_linear, cpu_moe, cpu_native_decode
from pagellm.platforms._common import classproperty, gib
from pagellm.plugins.hookspecs import hookimpl

if TYPE_CHECKING:
    from pagellm.core.config import EngineConfig
    from pagellm.core.native_decode import DenseDecoder, DraftHead, NativeDecodeStep, NativeHeadStep

PAGELLM_PLUGIN_API = "1.0"

logger = logging.getLogger("pagellm")

PACKED_LINEAR_BATCH_HINT = 64
"""Rows oneDNN lays packed weights out for (a hint: every row count works); decode batches are about this."""

DEFAULT_KV_CACHE_SPACE = 4.0
"""GiB of RAM for the KV cache when --kv-cache-space is not given."""

DEFAULT_TOKEN_BUDGET = 512
"""Tokens a step may schedule when --max-num-batched-tokens is not given (at least max_num_seqs). A CPU
multiplies ~100-1000x slower than a GPU, so the engine-wide 2048 makes a step that mixes a prefill chunk into
running decodes last seconds: every decode in it waits that long for its next token. At 256 rows a GEMM is
already far past the point where reading the weights costs more than multiplying them, so smaller chunks
cost a CPU little: model S bf16 on an AVX2 AMD EPYC, W2 at 1 request/s, ITL p99 7.3 s at 2048, 2.0 s at 512,
1.1 s at 256; W1 offline 96.3 / 92.8 output tok/s at 2048, 95.5 / 90.3 at 512, 91.5 / 89.3 at 256 (one
process alternating)."""

ISA_FEATURES = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
"""x86 flags that decide which kernels are fast here; reported by `describe()`."""

BF16_FEATURES = {"avx512_bf16", "amx_bf16"}
"""With either, bfloat16 matmuls run natively and beat float32; without, bfloat16 is emulated and slower."""


def _read_text(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def _cpuinfo_field(name: str) -> str | None:
    """The first `name : value` line of /proc/cpuinfo (the boot CPU's)."""
    for line in _read_text("/proc/cpuinfo").splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == name:
            return value.strip()
    return None


def _cpu_model() -> str:
    return _cpuinfo_field("model name") or pyplatform.processor() or pyplatform.machine() or "unknown CPU"


def _cpu_flags() -> set[str]:
    return set((_cpuinfo_field("flags") or "").split())


def _usable_cores() -> int:
    """Cores this process may run on (taskset, cgroups cpusets), not the machine's total."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _meminfo() -> dict[str, int]:
    """/proc/meminfo in bytes, or from sysconf where there is no /proc."""
    values = {}
    for line in _read_text("/proc/meminfo").splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            values[key] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    if "MemTotal" in values and "MemAvailable" in values:
        return values
    page = os.sysconf("SC_PAGE_SIZE")
    return {
        "MemTotal": page * os.sysconf("SC_PHYS_PAGES"),
        "MemAvailable": page * os.sysconf("SC_AVPHYS_PAGES"),
    }


class CpuPlatform(Platform):
    name = "cpu"
    device_type = "cpu"
    priority = 0
    supported_dtypes = (torch.float32, torch.bfloat16, torch.float16)
    attention_backends = ("CPU_ATTN", "TORCH_SDPA", "FLEX_ATTENTION")
    capabilities = frozenset({FLOAT8, DTYPE_VIEWS})
    """torch's CPU kernels cast float8 and view bytes as other dtypes (no Triton backend, no FP8 matmul)."""

    @classproperty
    def default_dtype(cls) -> torch.dtype:
        """bfloat16 where the CPU computes it natively, else float32."""
        return torch.bfloat16 if _cpu_flags() & BF16_FEATURES else torch.float32

    @classmethod
    def availability(cls) -> Availability:
        return Availability.yes(f"{_cpu_model()}, {_usable_cores()} core(s) usable")

    @classmethod
    def device_name(cls, index: int = 0) -> str:
        return _cpu_model()

    @classmethod
    def total_memory(cls, index: int = 0) -> int:
        return _meminfo()["MemTotal"]

    @classmethod
    def free_memory(cls, index: int = 0) -> int:
        """MemAvailable: free RAM plus what the kernel can reclaim (page cache) without swapping."""
        return _meminfo()["MemAvailable"]

    @classmethod
    def memory_in_use(cls, model_bytes: int, index: int = 0) -> int:
        """Only the model: the rest of the RAM in use belongs to other processes, not to this device."""
        return model_bytes

    @classmethod
    def kv_cache_bytes(cls, config: EngineConfig, model_bytes: int, peak_bytes: int) -> int:
        """`kv_cache_space` GiB, refused when more than the memory available now (the model is loaded)."""
        space = DEFAULT_KV_CACHE_SPACE if config.kv_cache_space is None else config.kv_cache_space
        wanted = int(space * GiB)
        available = cls.free_memory()
        if wanted > available:
            raise ConfigError(
                f"kv_cache_space {space:g} GiB is more than the {gib(available)} of memory available now; "
                f"lower --kv-cache-space to {available / GiB:.1f} or less"
            )
        return wanted

    @classmethod
    def check_and_update_config(cls, config: EngineConfig) -> None:
        if config.max_num_batched_tokens is None:
            config.max_num_batched_tokens = max(DEFAULT_TOKEN_BUDGET, config.max_num_seqs)
        if config.kv_cache_space is None:
            config.kv_cache_space = DEFAULT_KV_CACHE_SPACE
        if config.kv_cache_space <= 0:
            raise ConfigError(
                f"kv_cache_space must be more than 0 GiB, got {config.kv_cache_space:g}; "
                f"pass --kv-cache-space {DEFAULT_KV_CACHE_SPACE:g}"
            )

    @classmethod
    def batch_invariant_unsupported(cls, dtype: torch.dtype) -> str | None:
        """The panel kernel (float32 and bfloat16 weights) and CPU_ATTN's native kernel, in their fixed
        order, are batch-invariant; both need the native kernels."""
        if dtype not in (torch.float32, torch.bfloat16):
            return f"batch-invariant kernels on CPU run float32 and bfloat16, not {dtype_name(dtype)}"
        if _kernels() is None:
            return "batch-invariant mode needs pagellm's native CPU kernels, which cannot be had here"
        return None

    @classmethod
    def build_kernels_in_background(cls) -> bool:
        """The native kernels (platforms/cpu_kernels) in a niced process of their own, ~40 s on two cores
        from an empty cache, which a server would otherwise wait for before its first answer."""
        from pagellm.platforms import cpu_kernels

        return cpu_kernels.build_in_background()

    @classmethod
    def kernels_built(cls) -> bool:
        from pagellm.platforms import cpu_kernels

        return cpu_kernels.background_build_done()

    @classmethod
    def native_decode_step(
        cls, model: DenseDecoder, kv_caches: list[torch.Tensor], attention: list[Any], block_size: int
    ) -> tuple[NativeDecodeStep | None, str]:
        """cpu_kernels/native_decoder.cpp where the model's parts are on its kernels
        (`cpu_native_decode.py` says which)."""
        return cpu_native_decode.native_decode_step(model, kv_caches, attention, block_size)

    @classmethod
    def native_head_step(
        cls, head: DraftHead, kv_cache: torch.Tensor, attention: Any, block_size: int
    ) -> tuple[NativeHeadStep | None, str]:
        """cpu_kernels/native_decoder.cpp's head pass where the head's parts are on its kernels."""
        return cpu_native_decode.native_head_step(head, kv_cache, attention, block_size)

    @classmethod
    def pack_linear(cls, weight: torch.Tensor, batch_invariant: bool = False) -> PackedLinear | None:
        """bfloat16 on a CPU with AMX: pagellm's AMX kernel (platforms/cpu_kernels/linear_amx.cpp), which
        streams the weights at up to 1.35x oneDNN's rate at decode batch sizes and matches it (within 5%)
        at 2048 rows. bfloat16 on a CPU with AVX-512 BF16 but no AMX (AMD Zen 4 and 5): pagellm's pair
        kernel (platforms/cpu_kernels/linear_bf16_pairs.cpp, vdpbf16ps), which on a 2-core Zen 4 streamed
        model S's weights at 32 GB/s a decode step against oneDNN's 19 and matched it at 64 rows.
        Otherwise oneDNN with the weight reordered once into its blocked layout: F.linear reorders it on
        every call, which at decode batch sizes costs as much as the GEMM (1.3-1.9x faster at 1-64 rows,
        same bits). Where oneDNN cannot pack bfloat16 (AVX2-only CPUs, `onednn_packs`), and for float32 on
        AVX2-only CPUs: pagellm's panel kernel (platforms/cpu_kernels/linear_panels.cpp), since there
        F.linear widens a bfloat16 weight every call (~10x slower at 16 rows) and MKL's float32 GEMM, which
        AVX2-only AMD CPUs get, is 1.1-4x slower at 1-64 rows (docs/backends.md). float32 on AVX-512 CPUs
        keeps F.linear; so does any dtype where the kernels cannot be had. Batch-invariant: the panel
        kernel in its fixed order, for every float32 and bfloat16 weight on any CPU."""
        kernels = _kernels()
        if batch_invariant:
            return cpu_linear.pack(weight, fixed_order=True)
        if weight.dtype == torch.float32:
            avx2_only = kernels is not None and kernels.isa() == "avx2"
            return cpu_linear.pack(weight) if avx2_only and cpu_linear.worth_packing(weight) else None
        if weight.dtype not in (torch.bfloat16, torch.float16):
            return None
        if _amx_kernels() is not None and weight.dtype == torch.bfloat16:
            return PackedLinear(kernels.amx_pack(weight), _AmxLinear(weight.shape[0]))
        if (
            weight.dtype == torch.bfloat16
            and _bf16_pair_kernels() is not None
            and cpu_linear.worth_packing(weight)
        ):
            return cpu_linear.pack_pairs(weight)
        if onednn_packs(weight.dtype):
            packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACKED_LINEAR_BATCH_HINT)
            return PackedLinear(packed, _onednn_linear)
        if weight.dtype == torch.bfloat16 and kernels is not None and cpu_linear.worth_packing(weight):
            return cpu_linear.pack(weight)
        return None

    @classmethod
    def pack_per_head(cls, weight: torch.Tensor) -> PackedLinear | None:
        """bfloat16 per-head weights on a CPU with AVX-512 BF16: the pair kernel, one call for every head
        (`cpu_bf16_pair_heads`), where torch.bmm read model D's 2 MiB of MLA up-projections a layer at ~14
        GB/s at one row (~150 us, 2-core AMD EPYC Zen 4). Otherwise None (torch.bmm)."""
        if (
            weight.dtype != torch.bfloat16
            or weight.dim() != 3
            or weight.shape[2] % 2
            or _bf16_pair_kernels() is None
            or not cpu_linear.worth_packing(weight[0])
        ):
            return None
        return cpu_linear.pack_pair_heads(weight)

    @classmethod
    def pack_moe(
        cls,
        w13: torch.Tensor,
        w2: torch.Tensor,
        w13_bias: torch.Tensor | None,
        w2_bias: torch.Tensor | None,
        activation: str,
        w13_scale: torch.Tensor | None = None,
        w2_scale: torch.Tensor | None = None,
    ) -> PackedMoE | None:
        """float32, bfloat16, int8 and fp8 (e4m3) experts on pagellm's native kernel
        (platforms/cpu_kernels/fused_moe.cpp, packed by platforms/cpu_moe.py): each chosen expert's weights
        read once a step, the activation in the first GEMM's epilogue. None (the PyTorch reference) for
        other dtypes, or where the kernels cannot be had here (no compiler, PAGELLM_CPU_KERNELS=0:
        `cpu_kernels.load` logs why, once)."""
        if w13.dtype not in cpu_moe.DTYPES or w2.dtype != w13.dtype:
            return None
        kernels = _kernels()
        if kernels is None:
            return None
        return cpu_moe.pack(
            w13, w2, w13_bias, w2_bias, activation, kernels.fused_moe_isa(), w13_scale, w2_scale
        )

    @classmethod
    def pack_moe_mxfp4(
        cls,
        experts: Mxfp4Experts,
        w13_bias: torch.Tensor | None,
        w2_bias: torch.Tensor | None,
        activation: str,
    ) -> PackedMoE | None:
        """GPT-OSS's MXFP4 experts kept packed on the GGUF experts kernel (platforms/cpu_gguf_moe.py: GGML's
        MXFP4 blocks, the checkpoint's bytes), biases and the clamped SwiGLU included; None where the kernels
        cannot be had here."""
        return cpu_gguf_moe.pack_mxfp4(experts, w13_bias, w2_bias, activation)

    @classmethod
    def recurrent_kernels(cls) -> RecurrentKernels:
        """The decode updates on pagellm's native kernels (platforms/cpu_kernels/recurrent.cpp): each
        sequence's conv window and delta-rule or SSM state read and written once, in place in its slot,
        instead of the references' dozen passes and their gather and scatter of every state (one layer's
        conv and delta rule at batch 64, Model H's shape: 5.7 ms against 84, docs/backends.md). Prefill
        keeps the references. None of them where the kernels cannot be had (no compiler, PAGELLM_CPU_KERNELS=0)."""
        kernels = _kernels()
        if kernels is None:
            return RecurrentKernels()
        return RecurrentKernels(
            conv1d_update=kernels.conv1d_update,
            gated_delta_rule_update=kernels.gated_delta_rule_update,
            selective_state_update=kernels.selective_state_update,
        )

    @classmethod
    def sparse_attention_kernels(cls) -> SparseAttentionKernels:
        """The indexer's scores and the attention over the chosen tokens on pagellm's native kernels
        (platforms/cpu_kernels/sparse_attention.cpp): cached rows read in place through their slots and
        widened in registers, where the references gather and widen copies of them (a decode at 16k tokens:
        indexer keys and chosen rows, model D's shapes, docs/performance-log.md). None of them where the
        kernels cannot be had."""
        kernels = _kernels()
        if kernels is None:
            return SparseAttentionKernels()
        return SparseAttentionKernels(kernels.sparse_index_scores, kernels.sparse_attend_rows)

    @classmethod
    def argmax(cls, logits: torch.Tensor) -> torch.Tensor:
        """The native kernel's (platforms/cpu_kernels/argmax.cpp) for float32 and bfloat16 rows: one pass
        with 16 lanes of running maxima, 8x torch's max(dim) on 64 x 151936 bfloat16 logits here."""
        kernels = _kernels()
        if (
            kernels is None
            or logits.dim() != 2
            or logits.dtype not in (torch.float32, torch.bfloat16)
            or logits.stride(1) != 1
            or logits.shape[1] == 0
        ):
            return super().argmax(logits)
        return kernels.argmax_rows(logits)

    @classmethod
    def compile_model(cls, model: torch.nn.Module) -> Callable[..., torch.Tensor] | None:
        """Inductor over the whole forward (attention is one opaque op), shapes dynamic so one graph
        serves every token count. Needs a C++ compiler; compiled kernels are cached under pagellm's cache
        folder (`keep_compiled_code_in_cache_dir`). (Freezing the weights for prepacked oneDNN GEMMs
        measured slower here and compiled 4x longer, so it stays off.)"""
        compiler = os.environ.get("CXX", "c++")
        if shutil.which(compiler) is None:
            logger.warning(
                "no C++ compiler (%r), so the model runs eagerly; set CXX or install g++", compiler
            )
            return None
        return torch.compile(model, dynamic=True, options=COMPILE_OPTIONS)

    @classmethod
    def compile_ahead(
        cls, model: torch.nn.Module, args: tuple[torch.Tensor, ...], regional: bool = False
    ) -> Any | None:
        """The same inductor graph as `compile_model`, compiled ahead of time as one whole graph. Every guard
        is dropped (`guard_filter_fn`): what a guard would check is in the artifact's key instead
        (worker/compiled_forward.py), and a model whose traced code reads per-step state is not compiled
        this way. Floats stay constants (`specialize_float`): the precompile path cannot restart the trace
        that turning them into inputs needs. `regional`: with a Python wrapper, the only one that calls
        the layers' compile regions."""
        if shutil.which(os.environ.get("CXX", "c++")) is None:
            return None
        options = {**COMPILE_OPTIONS, "guard_filter_fn": lambda entries: [False] * len(entries)}
        if regional:
            options["cpp_wrapper"] = False
        compiled = torch.compile(model.forward, dynamic=True, fullgraph=True, options=options)
        with torch._dynamo.config.patch(specialize_float=True):
            return compiled.aot_compile((args, {}))

    @classmethod
    def describe(cls) -> dict[str, str]:
        flags = _cpu_flags()
        memory = _meminfo()
        facts = {
            "device": _cpu_model(),
            "cores_usable": str(_usable_cores()),
            "torch_threads": str(torch.get_num_threads()),
            "memory_total": gib(memory["MemTotal"]),
            "memory_available": gib(memory["MemAvailable"]),
            "default_dtype": dtype_name(cls.default_dtype),
        }
        facts.update({feature: "yes" if feature in flags else "no" for feature in ISA_FEATURES})
        return facts


COMPILE_OPTIONS = {
    # the graph's ~400 stride checks a call; every op in it returns contiguous outputs
    "size_asserts": False,
    "alignment_asserts": False,
    # the graph's wrapper (allocations, views, ~150 op calls a decode step) in C++ rather than Python:
    # model S's batch-64 decode step 79-81 -> 74-76 ms; the one-time compile takes longer
    "cpp_wrapper": True,
    # ... built apart from the kernels, at -O1 where they take -O3: model S's compile on one core of the
    # AMX Xeon 97 -> 65 s (the wrapper was 55 s of the C++ compiler's 70), its steps as fast (one user
    # 15.4-15.6 ms against 15.3-16.2, batch 16 21.4-21.7 against 21.6-21.8, alternated three times)
    "cpp_wrapper_build_separate": True,
}
"""Inductor and Dynamo options for the CPU model graph."""


@functools.cache
def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN prepacks and multiplies `dtype` weights on this CPU. Its half-precision reorder needs
    AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT, which an AVX2-only CPU (AMD Zen 3, older Intel) lacks: probed
    once with a small weight rather than guessed from the flags, since oneDNN's own rules change."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        weight = torch.ones(16, 16, dtype=dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACKED_LINEAR_BATCH_HINT)
        _onednn_linear(torch.ones(2, 16, dtype=dtype), packed, None)
    except RuntimeError as exc:
        logger.info("oneDNN cannot prepack %s weights on this CPU (%s)", dtype, exc)
        return False
    return True


def _onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Eager: oneDNN directly. Under torch.compile: one opaque op, because inductor cannot lower a
    prepacked weight (its layout assertion fails and the whole model would fall back to eager)."""
    if torch.compiler.is_compiling():
        return torch.ops.pagellm.onednn_linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


@torch.library.custom_op("pagellm::onednn_linear", mutates_args=())
def _onednn_linear_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


@_onednn_linear_op.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _kernels():
    """The native kernels, or None (no compiler, or PAGELLM_CPU_KERNELS=0)."""
    from pagellm.platforms import cpu_kernels

    return cpu_kernels.load()


def _amx_kernels():
    """The native kernels when they run the AMX linear here, else None (no AMX, no compiler, or
    PAGELLM_CPU_KERNELS=0: then oneDNN does every matmul)."""
    from pagellm.platforms import cpu_kernels

    if not _has_amx():
        return None
    kernels = cpu_kernels.load()
    if kernels is None or not kernels.amx_available():
        return None
    return kernels


def _bf16_pair_kernels():
    """The native kernels when they run the AVX-512 BF16 pair linear here (built for a CPU with it), else
    None."""
    kernels = _kernels()
    return kernels if kernels is not None and kernels.bf16_pairs_available() else None


@functools.cache
def _has_amx() -> bool:
    return {"amx_bf16", "amx_tile"} <= _cpu_flags()


class _AmxLinear:
    """x @ W^T + bias with W in the AMX kernel's tile layout (out_features kept: the layout pads it)."""

    def __init__(self, out_features: int):
        self.out_features = out_features

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return torch.ops.pagellm.amx_linear(x, weight, bias, self.out_features)
        return _amx_linear(x, weight, bias, self.out_features)


def _amx_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    """x [..., in] -> [..., out] bf16 on the kernel (which flattens x and rounds it to bf16)."""
    from pagellm.platforms import cpu_kernels

    return cpu_kernels.load().amx_linear(x, weight, bias, out_features)


# Defined here, implemented in C++ by the kernels' build (TORCH_LIBRARY_IMPL in cpu_kernels/ops.cpp), so a
# compiled graph's call never enters Python (a Python custom op cost ~18 us a call, x120 a decode step).
torch.library.define(
    "pagellm::amx_linear", "(Tensor x, Tensor weight, Tensor? bias, int out_features) -> Tensor"
)


@torch.library.register_fake("pagellm::amx_linear")
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], out_features), dtype=torch.bfloat16)


def pack_weight_only(
    weight: torch.Tensor, scale: torch.Tensor, activation_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A weight-only int8 or float8_e4m3fn layer's weight [out, in] and per-row scales in the panel kernel's
    layout (`cpu_linear.pack_quantized`), for `weight_only_linear`; None where that kernel cannot run it (not
    on CPU, activations other than float32 or bfloat16, no native kernels here): the layer then dequantizes
    its weight for `F.linear` on every call."""
    if (
        weight.device.type != "cpu"
        or weight.dtype not in cpu_linear.QUANTIZED
        or activation_dtype not in (torch.float32, torch.bfloat16)
        or _kernels() is None
    ):
        return None
    _explain_weight_only(dtype_name(weight.dtype))
    return cpu_linear.pack_quantized(weight, scale)


@functools.cache
def _explain_weight_only(weight_dtype: str) -> None:
    """Says once, at load, what weight-only quantization buys on this CPU: the panels halve the bytes a
    step reads, which is what a decode step of few rows waits on, but they multiply in float32 FMAs, so a
    step of many tokens (a prefill; W1 is mostly prefill work) gets no faster than bfloat16 and, beside
    AMX's bfloat16 tiles, slower. Measured on an AVX2 AMD EPYC (model S, one process alternating): W1
    90.1 output tok/s int8 against bfloat16's 97.9, the batch-64 decode step 185 against 251 ms."""
    if _amx_kernels() is not None:
        why = "bfloat16 linears here multiply on AMX tiles, the panels in float32 FMAs: prefills run slower"
    else:
        why = (
            "steps of many tokens are bound by float32 multiplies here, as bfloat16's are: prefills run at "
            "bfloat16's speed or a little slower"
        )
    logger.info(
        "weight-only %s linears on the CPU panel kernel: half the bytes of bfloat16 (faster decode steps); %s",
        weight_dtype,
        why,
    )


def weight_only_linear(
    x: torch.Tensor, panels: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    """x @ (weight * scale)^T + bias on the panel kernel, for a layer packed by `pack_weight_only`."""
    return cpu_linear.quantized_linear(x, panels, scale, bias, out_features)


def w8a8_available() -> bool:
    """True where int8 weights can run as W8A8 on AMX here (see `w8a8_linear`)."""
    return _amx_kernels() is not None


def pack_w8a8(weight: torch.Tensor) -> torch.Tensor:
    """An int8 weight [out, in] in the AMX kernel's tile layout (the same bytes, reordered)."""
    return _amx_kernels().amx_pack_int8(weight)


def w8a8_linear(
    x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    """x @ (weight * scale)^T + bias with x (bfloat16) quantized to int8 per token on the fly (max |x| / 127)
    and int8 x int8 products summed exactly in int32 on AMX; `scale` is float32 [out]. The `int8`
    quantization method's path on AMX CPUs: half the weight bytes of bf16 and exact integer sums."""
    if torch.compiler.is_compiling():
        return torch.ops.pagellm.amx_linear_w8a8(x, packed, scale, bias, out_features)
    return _w8a8_linear(x, packed, scale, bias, out_features)


def _w8a8_linear(
    x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    from pagellm.platforms import cpu_kernels

    rows = x.reshape(-1, x.shape[-1])
    out = cpu_kernels.load().amx_linear_w8a8(rows, packed, scale, bias, out_features)
    return out.reshape(*x.shape[:-1], out_features)


@torch.library.custom_op("pagellm::amx_linear_w8a8", mutates_args=())
def _w8a8_linear_op(
    x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    return _w8a8_linear(x, packed, scale, bias, out_features)


@_w8a8_linear_op.register_fake
def _(
    x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], out_features))


@hookimpl
def pagellm_platforms() -> list[type[Platform]]:
    return [CpuPlatform]
