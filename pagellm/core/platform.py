"""The `Platform` interface: one subclass per device family (cuda, rocm, xpu, cpu, tpu, or a vendor's).

Everything is a classmethod: a platform is a set of facts and queries about the machine, not an object
with state. `availability()` must stay cheap and side-effect free: it may import modules and read files,
but never create a device context or start a runtime (that broke Ray and forked workers in other engines).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from pagellm.core.sparse_kernels import SparseAttentionKernels
from pagellm.core.state import RecurrentKernels

if TYPE_CHECKING:
    from pagellm.core.config import EngineConfig
    from pagellm.core.moe import Mxfp4Experts, PackedMoE
    from pagellm.core.native_decode import DenseDecoder, DraftHead, NativeDecodeStep, NativeHeadStep

GiB = 1 << 30

FLOAT8 = "float8"
DTYPE_VIEWS = "dtype_views"
TRITON = "triton"
FP8_MATMUL = "fp8_matmul"
CAPABILITIES: dict[str, str] = {
    FLOAT8: "float8_e4m3fn tensors held on the device, copied and cast to and from the compute dtypes",
    DTYPE_VIEWS: "Tensor.view(dtype) across element sizes, e.g. uint8 bytes read as float16",
    TRITON: "Triton kernels compile for the device (a Triton backend for it, and the triton package)",
    FP8_MATMUL: "FP8 x FP8 matmuls with torch._scaled_mm (on devices new enough: see `min_capability`)",
}
"""The capabilities pagellm's platforms declare (`Platform.capabilities`) and its methods need
(`QuantMethod.requires`), with what each means; shown in the reason when one is missing."""


@dataclass(frozen=True)
class PackedLinear:
    """A weight repacked by `Platform.pack_linear` and the matmul that reads it."""

    weight: torch.Tensor
    matmul: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
    """(x, weight, bias) -> x @ W^T + bias"""


@dataclass(frozen=True)
class Availability:
    """Whether a platform can run here, and always why (or why not)."""

    ok: bool
    reason: str

    @classmethod
    def yes(cls, reason: str) -> Availability:
        return cls(True, reason)

    @classmethod
    def no(cls, reason: str) -> Availability:
        return cls(False, reason)

    def __bool__(self) -> bool:
        return self.ok


class Platform:
    """A device family. Subclass it, fill the facts, override the queries your device answers differently."""

    name: ClassVar[str]
    """Name users pass to `--device` (lower case): `cuda`, `cpu`, or a vendor's."""
    device_type: ClassVar[str]
    """torch device type: `cuda`, `xpu`, `cpu`, `xla`, ..."""
    dist_backend: ClassVar[str] = "gloo"
    """torch.distributed backend the ranks of a split model use on this device: gloo, nccl, xccl, ..."""
    priority: ClassVar[int] = 0
    """Auto-detection picks the available platform with the highest priority."""
    supported_dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float32,)
    default_dtype: ClassVar[torch.dtype] = torch.float32
    """dtype used for `--dtype auto` when the checkpoint's own dtype is not supported here."""
    attention_backends: ClassVar[tuple[str, ...]] = ()
    """Attention backend names in order of preference; may name backends from other packages."""
    capabilities: ClassVar[frozenset[str]] = frozenset()
    """What the device, with its torch build, can do beyond plain float math, by name (`CAPABILITIES` lists
    pagellm's; a vendor may name its own). A quantization method that needs one says so in
    `QuantMethod.requires` and is refused, with the reason, where the platform does not declare it; there is
    no list of methods a platform runs."""

    @classmethod
    def availability(cls) -> Availability:
        raise NotImplementedError

    @classmethod
    def device(cls, index: int = 0) -> torch.device:
        return torch.device(cls.device_type, index) if cls.device_type != "cpu" else torch.device("cpu")

    @classmethod
    def device_name(cls, index: int = 0) -> str:
        return cls.name

    @classmethod
    def device_capability(cls, index: int = 0) -> tuple[int, int] | None:
        """(major, minor) where the device family has versions (CUDA compute capability); else None."""
        return None

    @classmethod
    def device_count(cls) -> int:
        return 1

    @classmethod
    def total_memory(cls, index: int = 0) -> int:
        raise NotImplementedError

    @classmethod
    def free_memory(cls, index: int = 0) -> int:
        raise NotImplementedError

    @classmethod
    def memory_in_use(cls, model_bytes: int, index: int = 0) -> int:
        """Bytes of the device's memory taken once the model is loaded, which the KV cache must leave
        free; the engine passes it to `kv_cache_bytes` as `peak_bytes`.

        Used where `peak_memory_allocated` is None (else the model runner profiles a forward pass).
        Default, for a device with memory of its own: total less free, which counts the weights and any
        other process on it but no activation peak. A platform whose memory is the host's RAM, shared
        with every process on the machine, returns `model_bytes` (the cpu platform does)."""
        return cls.total_memory(index) - cls.free_memory(index)

    @classmethod
    def reset_peak_memory(cls, index: int = 0) -> None:
        """Restart the peak `peak_memory_allocated` reports at what the allocator holds now."""

    @classmethod
    def peak_memory_allocated(cls, index: int = 0) -> int | None:
        """Most bytes torch's allocator held on the device since `reset_peak_memory`, or None where the
        platform keeps no such counter. Where it does, the model runner sizes the KV cache by profiling:
        it runs a forward pass at the largest step and leaves free this peak plus `non_torch_memory`."""
        return None

    @classmethod
    def non_torch_memory(cls, index: int = 0) -> int:
        """Bytes in use on the device outside torch's allocator (the runtime's context, communication
        buffers, other processes), read when profiling; 0 by default."""
        return 0

    @classmethod
    def kv_cache_bytes(cls, config: EngineConfig, model_bytes: int, peak_bytes: int) -> int:
        """Bytes the KV cache may take, given the measured weight and peak activation memory.

        Accelerators: `gpu_memory_utilization` of total memory, less what the model took at its peak.
        """
        budget = int(cls.total_memory() * config.gpu_memory_utilization) - peak_bytes
        return max(budget, 0)

    @classmethod
    def preferred_attention_backends(cls) -> list[str]:
        return list(cls.attention_backends)

    @classmethod
    def check_and_update_config(cls, config: EngineConfig) -> None:
        """Apply this platform's defaults to `config` and raise ConfigError for settings it cannot run."""

    @classmethod
    def build_kernels_in_background(cls) -> bool:
        """Start building this platform's native kernels without waiting for them, where they are not built
        yet; True if a build started. Until `kernels_built()`, whatever asks for them gets the PyTorch path
        (`pack_linear` None, attention and experts on their references), and the engine takes them up between
        two steps after (worker/runner_build.py `take_up_kernels`). Default: nothing to build."""
        return False

    @classmethod
    def kernels_built(cls) -> bool:
        """Whether the build `build_kernels_in_background` started has ended (built or failed)."""
        return True

    @classmethod
    def pack_linear(cls, weight: torch.Tensor, batch_invariant: bool = False) -> PackedLinear | None:
        """This unquantized weight in a faster layout for the device's GEMM library, with the matmul that
        reads it (results equal to F.linear's up to rounding), or None. Called once per linear layer after
        the weights load; the layer then keeps only the packed weight.

        `batch_invariant` (passed only where `batch_invariant_unsupported` said None): the matmul's result for
        a row must not depend on how many rows the call has, and None is not an answer."""
        return None

    @classmethod
    def pack_per_head(cls, weight: torch.Tensor) -> PackedLinear | None:
        """Per-head weights [H, out, in] (MLA's W_UK^T and W_UV, `models/deepseek.LatentUpProjection`) in a
        layout whose matmul takes x [T, H, in] to [T, H, out], each head's x times its own W^T (bias None),
        or None: the model keeps its batched products (torch.bmm)."""
        return None

    @classmethod
    def batch_invariant_unsupported(cls, dtype: torch.dtype) -> str | None:
        """Why this platform cannot run `--batch-invariant` (every linear through `pack_linear(weight,
        batch_invariant=True)`, attention through a backend that `supports_batch_invariant`) in `dtype`;
        None when it can."""
        return f"the {cls.name} platform has no batch-invariant kernels"

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
        """A fused-MoE layer's stacked expert weights (`pagellm.core.moe` says the layout) in the device's
        kernel layout with the function that runs them, or None: the layer then runs
        `fused_experts_reference`. Called once per MoE layer after the weights load. Quantized experts
        (int8 or float8_e4m3fn `w13`/`w2`) come with their per-row scales; a platform whose kernel does
        not read them returns None."""
        return None

    @classmethod
    def pack_moe_mxfp4(
        cls,
        experts: Mxfp4Experts,
        w13_bias: torch.Tensor | None,
        w2_bias: torch.Tensor | None,
        activation: str,
    ) -> PackedMoE | None:
        """A fused-MoE layer's MXFP4 experts (GPT-OSS checkpoints' blocks, `pagellm.core.moe` says the
        layout) on a kernel that reads them packed, or None: the layer then dequantizes them to its dtype
        and `pack_moe` is asked instead. Called once per such layer after the weights load."""
        return None

    @classmethod
    def recurrent_kernels(cls) -> RecurrentKernels:
        """This device's kernels for the recurrent layers of hybrid models (Gated DeltaNet, Mamba-2); the
        fields left None run the plain-torch references. Asked once per model runner of a model that has
        such layers."""
        return RecurrentKernels()

    @classmethod
    def sparse_attention_kernels(cls) -> SparseAttentionKernels:
        """This device's kernels for sparse attention's passes over the cache (DeepSeek-V3.2's indexer and
        its chosen tokens); the fields left None run the torch references. Asked when the model runner is
        built and again when background-built kernels are taken up."""
        return SparseAttentionKernels()

    @classmethod
    def argmax(cls, logits: torch.Tensor) -> torch.Tensor:
        """Each row's index of its largest value, as `logits.max(dim=-1).indices` gives it (the first on
        ties, the first NaN where there is one): greedy sampling's one reduction over the vocabulary."""
        return logits.max(dim=-1).indices

    @classmethod
    def compile_model(cls, model: torch.nn.Module) -> Callable[..., torch.Tensor] | None:
        """The model's forward made faster for this device (torch.compile, graph capture), or None to run
        it eagerly. Called once after the weights load unless --enforce-eager; the model runner warms the
        result up on dummy steps and falls back to eager, with a warning, if that fails."""
        return None

    @classmethod
    def compile_ahead(
        cls, model: torch.nn.Module, args: tuple[torch.Tensor, ...], regional: bool = False
    ) -> Any | None:
        """The model's forward compiled for `args` before it runs, as an object with
        `save_compiled_function(path)` that `torch.compiler.load_compiled_function` reads back in another
        process (torch's AOT precompile: one whole graph, no guards kept), called as `fn(model, *args)`; or
        None where this device has no such compile (the runner then uses `compile_model`). The caller sets
        the forward context the trace reads. Raising says the model cannot be compiled this way.
        `regional`: the caller has marked the decoder layers as nested compile regions
        (worker/regional.py), to be compiled once each and called from the graph: the options that
        cannot call a region (a C++ wrapper) are off."""
        return None

    @classmethod
    def native_decode_step(
        cls, model: DenseDecoder, kv_caches: list[torch.Tensor], attention: list[Any], block_size: int
    ) -> tuple[NativeDecodeStep | None, str]:
        """A decode step of `model` in one native call over these KV caches (one per layer; `attention`:
        the layers' attention modules, whose backends hold their specs), or None; always with the reason,
        which start-up logs. Asked once, after the KV cache exists; the runner then calls it for every step
        of up to the step's `max_rows` rows (`core/native_decode.py`)."""
        return None, f"the {cls.name} platform has no native decode step"

    @classmethod
    def native_head_step(
        cls, head: DraftHead, kv_cache: torch.Tensor, attention: Any, block_size: int
    ) -> tuple[NativeHeadStep | None, str]:
        """An EAGLE-3 head's pass in one native call over its KV cache (`attention`: its attention module),
        or None; always with the reason, which start-up logs. The proposer then runs each pass of up to
        the step's `max_rows` rows through it."""
        return None, f"the {cls.name} platform has no native draft head step"

    @classmethod
    def supports_cuda_graphs(cls) -> bool:
        """Whether the model runner may capture decode steps in CUDA graphs (`torch.cuda.graph`) on this
        device, when the attention backend allows it (`AttentionBackend.cuda_graph_decode`) and
        --enforce-eager is off."""
        return False

    @classmethod
    def synchronize(cls) -> None:
        """Wait for queued device work (for timing)."""

    @classmethod
    def describe(cls) -> dict[str, str]:
        """Facts for `pagellm env` and the start-up log (device name, memory, ISA, ...). Cheap to call
        only when the platform is available."""
        return {"device": cls.device_name()}
