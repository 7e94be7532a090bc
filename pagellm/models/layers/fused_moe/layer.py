"""`FusedMoE`: the routed experts of one mixture-of-experts layer, stacked as `pagellm.core.moe` lays them
out, filled from any checkpoint layout the families use, run by the platform's kernel or the reference.

Split over a tensor-parallel group of N ranks in one of two ways. Sharded (the default): every rank holds
every expert, with its 1/N of the intermediate width (its gate and up rows of `w13`, its columns of `w2`),
like the dense MLP's column- and row-parallel pair. Expert parallel (`--enable-expert-parallel`): rank r
holds experts [r E/N, (r+1) E/N) whole and runs only the (token, expert) pairs routed to them. Either way
the output is this rank's partial sum; the caller all-reduces it (once, with a shared expert's part:
`SparseMoeBlock`).

Under a quantization method with an `expert_dtype` (`int8`, `fp8`) the experts are kept in that dtype with
a float32 scale per output row (`w13_scale`, `w2_scale`; weight-only): float checkpoint tensors are
quantized one expert part at a time as they load, quantized ones (`weight` in that dtype with its
`weight_scale`, as the dense layers read them) are copied. Sharded by width, a rank quantizes its own
columns of `w2`, so its row scales are its own.

Under a method that `loads_gguf_blocks` (`--quantization gguf` on a GGUF file) the experts arrive as the
file's stacked tensors (`gguf_experts.py`); the method's kernel may run them as they are (then they are the
layer's buffers `packed_0`, ... as the kernel reads them, and `w13`/`w2` are never allocated), or
they are dequantized expert by expert into `w13`/`w2`, allocated only then.

A layer built with `mxfp4` (GPT-OSS's released checkpoints) reads the checkpoint's MXFP4 pairs
(`gate_up_proj_blocks` / `_scales`, `down_proj_blocks` / `_scales`). A whole layer (every expert, full width,
not quantized again) keeps them as they are (`mxfp4`: the checkpoint's bytes, gate rows then up rows) for the
platform's kernel (`Platform.pack_moe_mxfp4`); where the platform has none, the model runner has the layer
dequantize them then (`dequantize_mxfp4`). A split layer dequantizes each pair as it arrives and keeps its part.
"""

from __future__ import annotations

import torch
from torch import nn

from pagellm.core.errors import ConfigError
from pagellm.core.moe import (
    ACTIVATIONS,
    QUANTIZED_DTYPES,
    SILU,
    Mxfp4Experts,
    PackedMoE,
    fused_experts_reference,
)
from pagellm.core.mxfp4 import dequantize_mxfp4
from pagellm.core.platform import Platform
from pagellm.core.quant import QuantMethod
from pagellm.distributed import Group
from pagellm.models.layers.fused_moe.gguf_experts import GgufExpertBlocks
from pagellm.models.loader import CheckpointSlice

PER_EXPERT = {
    "gate_proj": ("w13", 0),
    "up_proj": ("w13", 1),
    "down_proj": ("w2", 0),
    "w1": ("w13", 0),  # Mixtral
    "w3": ("w13", 1),
    "w2": ("w2", 0),
}
"""Per-expert checkpoint modules (`experts.{e}.<name>.weight`) -> (parameter, part: 0 gate, 1 up)."""

MXFP4_PROJECTIONS = {"gate_up_proj": "w13", "down_proj": "w2"}
"""GPT-OSS's MXFP4 checkpoint tensors (`<name>_blocks`, `<name>_scales`) -> the parameter they fill."""


class FusedMoE(nn.Module):
    """`w13` [E, 2I, H] (gate rows, then up rows), `w2` [E, H, I], optional `w13_bias` [E, 2I] and
    `w2_bias` [E, H], for this rank's experts and width (E and I are the rank's own).

    Checkpoint tensors reach `load_checkpoint` by their name below `experts.` (`copy_weights_with_experts`):
    per expert, `{e}.gate_proj/up_proj/down_proj.weight` (Qwen, DeepSeek) or `{e}.w1/w3/w2.weight`
    (Mixtral), which transformers 5's `save_pretrained` still writes for those families although its
    modules hold the experts fused; or fused, GPT-OSS's `gate_up_proj` [E, H, 2I] with gate and up
    interleaved column by column, `gate_up_proj_bias` [E, 2I] (interleaved too), `down_proj` [E, I, H] and
    `down_proj_bias` [E, H] (transposed against our layout: GPT-OSS multiplies x @ W)."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        dtype: torch.dtype,
        tp: Group | None = None,
        expert_parallel: bool = False,
        activation: str = SILU,
        bias: bool = False,
        quant_method: QuantMethod | None = None,
        mxfp4: bool = False,
    ):
        super().__init__()
        tp = tp or Group()
        if activation not in ACTIVATIONS:
            raise ConfigError(f"expert activation {activation!r} is not supported; supported: {ACTIVATIONS}")
        self.activation = activation
        self.expert_parallel = expert_parallel and tp.size > 1
        if self.expert_parallel:
            if num_experts % tp.size:
                raise ConfigError(
                    f"--enable-expert-parallel: the model's {num_experts} experts do not divide over "
                    f"--tensor-parallel-size {tp.size}",
                    param="enable_expert_parallel",
                )
            self.num_local_experts, width = num_experts // tp.size, intermediate_size
            self.first_expert, self.width_start = tp.rank * self.num_local_experts, 0
        else:
            if intermediate_size % tp.size:
                raise ConfigError(
                    f"--tensor-parallel-size {tp.size}: the experts' width {intermediate_size} does not divide "
                    f"by it (--enable-expert-parallel splits the experts instead)",
                    param="tensor_parallel_size",
                )
            self.num_local_experts, width = num_experts, intermediate_size // tp.size
            self.first_expert, self.width_start = 0, tp.rank * width
        self.width = width
        self.quantizer = quant_method if quant_method and quant_method.expert_dtype else None
        """The method whose `quantize_rows` quantizes float checkpoint experts; None: unquantized experts.
        (Not named `quant_method`: the loader calls that attribute's linear-layer hooks.)"""
        weight_dtype = self.quantizer.expert_dtype if self.quantizer else dtype
        self.hidden_size, self.weight_dtype, self.has_bias = hidden_size, weight_dtype, bias
        """The experts' shape and dtype, which outlive `use_packed` (the benchmark floor reads them)."""
        self.bias_rank = tp.rank == 0 or self.expert_parallel
        """Whether this rank adds `w2_bias`: a sharded layer's partial sums are added up, so only one does."""
        e, h = self.num_local_experts, hidden_size
        self.gguf = quant_method if quant_method is not None and quant_method.loads_gguf_blocks else None
        """The method whose GGUF experts this layer may keep as the file's blocks (`gguf_experts.py`)."""
        self.gguf_blocks = GgufExpertBlocks() if self.gguf is not None else None
        self.expert_block_bytes: int | None = None
        """The bytes of one expert's blocks (GGUF or MXFP4) once the layer keeps them (the benchmark floor
        reads it)."""
        self.dtype = dtype
        self.mxfp4_parts: dict[str, dict[str, torch.Tensor]] | None = {} if mxfp4 else None
        """A GPT-OSS checkpoint's MXFP4 tensors, gathered until both of a pair are here."""
        self.mxfp4: Mxfp4Experts | None = None
        """The experts as the checkpoint's MXFP4 blocks, until the model runner packs or dequantizes them."""
        self._keeps_mxfp4 = (
            mxfp4 and self.quantizer is None and (e, width) == (num_experts, intermediate_size)
        )
        self._shapes = {"w13": (e, 2 * width, h), "w2": (e, h, width)}
        # a GGUF file's or MXFP4 checkpoint's experts may stay its blocks: the float ones are allocated when
        # float weights arrive
        blocks = self.gguf is not None or mxfp4
        self.w13 = _parameter(torch.empty(0 if blocks else self._shapes["w13"], dtype=weight_dtype))
        self.w2 = _parameter(torch.empty(0 if blocks else self._shapes["w2"], dtype=weight_dtype))
        quantized = self.quantizer is not None
        self.w13_scale = _parameter(torch.empty(e, 2 * width, dtype=torch.float32)) if quantized else None
        self.w2_scale = _parameter(torch.empty(e, h, dtype=torch.float32)) if quantized else None
        self.w13_bias = _parameter(torch.empty(e, 2 * width, dtype=dtype)) if bias else None
        self.w2_bias = _parameter(torch.empty(e, h, dtype=dtype)) if bias else None
        self.packed: PackedMoE | None = None
        """The platform's kernel over its copy of the weights (`Platform.pack_moe`), set by the model runner."""
        self.pending_gguf_blocks: dict[str, tuple[torch.Tensor, int]] | None = None
        """A GGUF file's experts while the kernel that reads them builds (`take_up_kernels`)."""
        self._filled: set[tuple[str, int, int]] = set()  # (parameter, local expert, part) loaded

    def forward(
        self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        """This rank's part of sum_k topk_weights[t, k] * expert(topk_ids[t, k], hidden[t]) -> [T, H]."""
        if not self.expert_parallel:
            return self._run(hidden, topk_weights, topk_ids)
        # only the pairs routed to this rank's experts, each as a token of its own (top-1 routing)
        local = topk_ids - self.first_expert
        mine = (local >= 0) & (local < self.num_local_experts)
        tokens, _ = mine.nonzero(as_tuple=True)
        out = torch.zeros(hidden.shape[0], hidden.shape[1], dtype=torch.float32, device=hidden.device)
        if tokens.numel():
            part = self._run(hidden[tokens], topk_weights[mine].unsqueeze(1), local[mine].unsqueeze(1))
            out.index_add_(0, tokens, part.float())
        return out.to(hidden.dtype)

    def _run(self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return self.packed(hidden, topk_weights, topk_ids)
        args = (hidden, self.w13, self.w2, topk_weights, topk_ids, self.activation)
        rest = (self.w13_bias, self.w2_bias, self.w13_scale, self.w2_scale)
        if torch.compiler.is_compiling():
            return torch.ops.pagellm.moe_reference(*args, *rest)
        # eager: the function itself; the op's own eager path imports torch._dynamo on its first call (1.5-2.5 s
        # of the first step of a start that compiles nothing yet)
        return _moe_reference_eager(*args, *rest)

    def use_packed(self, packed: PackedMoE | None) -> None:
        """Run the experts with the platform's kernel, which holds its own copy of the weights (so the
        plain ones are dropped; the tensors it names in `weights` become this layer's buffers); None: keep
        them and the reference."""
        if packed is None:
            return
        self.packed = packed
        self.w13 = self.w2 = self.w13_bias = self.w2_bias = self.w13_scale = self.w2_scale = None
        self._drop_mxfp4()
        for i, tensor in enumerate(packed.weights):
            self.register_buffer(f"packed_{i}", tensor)

    def take_up_kernels(self) -> None:
        """The experts of a GGUF file, widened while the kernel that reads their blocks was building (kept
        aside then by `_load_gguf_blocks`), on that kernel now that it is here; the widened ones go. Called
        by the model runner between two steps; nothing changes if the method still has no kernel for them."""
        blocks, self.pending_gguf_blocks = self.pending_gguf_blocks, None
        packed = self.gguf.pack_gguf_experts(blocks, self.activation, self.w13.device) if blocks else None
        if packed is not None:
            self.expert_block_bytes = sum(raw[0].numel() for raw, _ in blocks.values())
            self.use_packed(packed)

    def dequantize_mxfp4(self) -> None:
        """The kept MXFP4 experts dequantized into `w13`/`w2` in the model's dtype (exact), for a platform
        with no kernel that reads them."""
        experts = self.mxfp4
        self._drop_mxfp4()
        self._store(
            "w13", (), dequantize_mxfp4(experts.w13_blocks, experts.w13_scales, self.dtype), "gate_up_proj"
        )
        self._store("w2", (), dequantize_mxfp4(experts.w2_blocks, experts.w2_scales, self.dtype), "down_proj")

    def _drop_mxfp4(self) -> None:
        if self.mxfp4 is not None:
            self.mxfp4 = None
            for name in ("w13_blocks", "w13_scales", "w2_blocks", "w2_scales"):
                delattr(self, f"mxfp4_{name}")

    # -- loading ------------------------------------------------------------------------------------------

    def load_checkpoint(self, name: str, tensor: torch.Tensor | CheckpointSlice) -> None:
        """Load checkpoint tensor `experts.<name>` (see the class docstring for the names), reading only
        what this rank keeps: nothing of other ranks' experts, only its width of the others."""
        head, _, rest = name.partition(".")
        if head.isdigit():
            self._load_expert(int(head), rest, tensor)
        elif self.gguf_blocks is not None and name.endswith((".qweight", ".qweight_type")):
            if self.gguf_blocks.add(name, tensor):
                self._load_gguf_blocks()
        elif self.mxfp4_parts is not None and name.endswith(("_blocks", "_scales")):
            self._load_mxfp4(name, tensor)
        elif name in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"):
            self._load_fused(name, tensor)
        else:
            raise ConfigError(f"checkpoint tensor experts.{name} has no counterpart in {type(self).__name__}")

    def _load_gguf_blocks(self) -> None:
        """The three stacked tensors of a GGUF file's experts, all here: kept as they are on the method's
        kernel (registered as buffers `packed_0`, ..., so the model's bytes count them) where it has
        one for their types and this rank holds the layer whole, else dequantized expert by expert."""
        blocks, self.gguf_blocks = self.gguf_blocks.blocks, None
        whole = tuple(blocks["gate_proj"][0].shape[:2]) == (self.num_local_experts, self.width)
        packed = (
            self.gguf.pack_gguf_experts(blocks, self.activation, self.w13.device)
            if whole and not self.has_bias
            else None
        )
        if packed is not None:
            self.expert_block_bytes = sum(raw[0].numel() for raw, _ in blocks.values())
            self.use_packed(packed)
            return
        if whole and not self.has_bias and self.gguf.waits_for_kernels(self.w13.device):
            self.pending_gguf_blocks = blocks  # packed by `take_up_kernels`; widened until then
        for module, (raw, type_id) in blocks.items():
            for expert in range(self.first_expert, self.first_expert + self.num_local_experts):
                weight = self.gguf.dequantize_gguf(raw[expert], type_id, self.weight_dtype)
                self._load_expert(expert, f"{module}.weight", weight)

    def _load_mxfp4(self, name: str, tensor: torch.Tensor | CheckpointSlice) -> None:
        """One of a GPT-OSS checkpoint's MXFP4 tensors (`<projection>_blocks` [E, N, K/32, 16] or
        `_scales` [E, N, K/32] of the weight [E, N, K] it multiplies as x @ W^T; gate_up's rows interleave
        gate and up). Once its partner is here: kept (a whole layer) or dequantized into this rank's part."""
        base, _, part = name.rpartition("_")
        if base not in MXFP4_PROJECTIONS:
            raise ConfigError(f"checkpoint tensor experts.{name} has no counterpart in {type(self).__name__}")
        pair = self.mxfp4_parts.setdefault(base, {})
        pair[part] = _read(tensor)
        if len(pair) < 2:
            return
        del self.mxfp4_parts[base]
        blocks, scales = pair["blocks"], pair["scales"]
        param = MXFP4_PROJECTIONS[base]
        if not self._keeps_mxfp4:  # as transformers keeps it, [E, K, N]
            self._load_fused(base, dequantize_mxfp4(blocks, scales, self.dtype).transpose(-1, -2))
            return
        expected = self._shapes[param][:2] + (self._shapes[param][2] // 32, 16)
        if tuple(blocks.shape) != expected or tuple(scales.shape) != expected[:3]:
            raise ConfigError(
                f"checkpoint tensors experts.{base}_blocks {tuple(blocks.shape)} and _scales "
                f"{tuple(scales.shape)} do not fit MXFP4 experts of {expected} and {expected[:3]}; the config "
                f"does not match the weights"
            )
        if param == "w13":  # row 2i gate i, 2i + 1 up i -> the gate rows, then the up rows
            blocks = torch.cat([blocks[:, 0::2], blocks[:, 1::2]], dim=1)
            scales = torch.cat([scales[:, 0::2], scales[:, 1::2]], dim=1)
        self.register_buffer(f"mxfp4_{param}_blocks", blocks.contiguous())
        self.register_buffer(f"mxfp4_{param}_scales", scales.contiguous())
        self._filled_all(param, parts=2 if param == "w13" else 1)
        if all(hasattr(self, f"mxfp4_{p}_blocks") for p in ("w13", "w2")):
            self.mxfp4 = Mxfp4Experts(
                self.mxfp4_w13_blocks, self.mxfp4_w13_scales, self.mxfp4_w2_blocks, self.mxfp4_w2_scales
            )
            self.expert_block_bytes = self.mxfp4.nbytes // self.num_local_experts

    def _load_expert(self, expert: int, name: str, tensor: torch.Tensor | CheckpointSlice) -> None:
        module, _, kind = name.partition(".")
        scale = kind == "weight_scale" and self.quantizer is not None
        if module not in PER_EXPERT or (kind != "weight" and not scale):
            raise ConfigError(f"checkpoint tensor experts.{expert}.{name} has no counterpart in FusedMoE")
        local = expert - self.first_expert
        if not 0 <= local < self.num_local_experts:
            return  # another rank's expert
        param, part = PER_EXPERT[module]
        w, label = self.width, f"{expert}.{name}"
        rows = slice(part * w, (part + 1) * w) if param == "w13" else slice(None)
        if scale:  # w13's rows are split by width; w2's are whole (its columns are)
            start, count = (self.width_start, w) if param == "w13" else (0, self.hidden_size)
            _copy(getattr(self, f"{param}_scale").data[local, rows], _scale_rows(tensor, start, count), label)
            self._filled.add((f"{param}_scale", local, part))
            return
        if param == "w13":
            quantized = self._store("w13", (local, rows), _read(tensor, (0, self.width_start, w)), label)
        else:
            quantized = self._store("w2", (local,), _read(tensor, (1, self.width_start, w)), label)
        self._filled.update((p, local, part) for p in ([param, f"{param}_scale"] if quantized else [param]))

    def _store(self, param: str, index: tuple, tensor: torch.Tensor, name: str) -> bool:
        """Copy `tensor` into `param`[index]: as it is, or quantized row by row into quantized experts,
        filling their scales too (returns True then; quantized checkpoint values are copied as they are
        and their scales come separately)."""
        if getattr(self, param).numel() == 0:  # held empty for GGUF blocks that did not come
            setattr(self, param, _parameter(self.w13.new_empty(self._shapes[param])))
        target = getattr(self, param).data[index]
        if self.quantizer is None or tensor.dtype == self.weight_dtype:
            _copy(target, tensor, name)
            return False
        if tensor.dtype in QUANTIZED_DTYPES or not tensor.dtype.is_floating_point:
            raise ConfigError(
                f"checkpoint tensor experts.{name} is {tensor.dtype}; these experts are quantized to "
                f"{self.weight_dtype} and read float or {self.weight_dtype} weights"
            )
        values, scale = self.quantizer.quantize_rows(tensor)
        _copy(target, values, name)
        getattr(self, f"{param}_scale").data[index].copy_(scale)
        return True

    def _load_fused(self, name: str, tensor: torch.Tensor | CheckpointSlice) -> None:
        experts = (0, self.first_expert, self.num_local_experts)
        w, start = self.width, self.width_start
        if name == "gate_up_proj":  # [E, H, 2I], column 2i gate i, column 2i + 1 up i
            t = _read(tensor, experts, (2, 2 * start, 2 * w))
            quantized = self._store(
                "w13", (), torch.cat([t[..., ::2], t[..., 1::2]], 2).transpose(1, 2), name
            )
            self._filled_all("w13", parts=2, scaled=quantized)
        elif name == "down_proj":  # [E, I, H]
            quantized = self._store("w2", (), _read(tensor, experts, (1, start, w)).transpose(1, 2), name)
            self._filled_all("w2", parts=1, scaled=quantized)
        elif self.w13_bias is None:
            raise ConfigError(f"checkpoint tensor experts.{name}: this model's experts have no biases")
        elif name == "gate_up_proj_bias":  # [E, 2I], interleaved
            t = _read(tensor, experts, (1, 2 * start, 2 * w))
            _copy(self.w13_bias.data, torch.cat([t[:, ::2], t[:, 1::2]], dim=1), name)
            self._filled_all("w13_bias", parts=2)
        else:  # down_proj_bias [E, H]
            t = _read(tensor, experts)
            _copy(self.w2_bias.data, t if self.bias_rank else torch.zeros_like(t), name)
            self._filled_all("w2_bias", parts=1)

    def _filled_all(self, param: str, parts: int, scaled: bool = False) -> None:
        """Mark `param` filled for every expert (and its scale, where `scaled`)."""
        names = [param, f"{param}_scale"] if scaled else [param]
        self._filled.update(
            (name, e, p) for name in names for e in range(self.num_local_experts) for p in range(parts)
        )

    def loaded_parameters(self) -> set[str]:
        """The parameters every one of whose experts (and gate/up parts) the checkpoint filled."""
        parts = {"w13": 2, "w2": 1, "w13_bias": 2, "w2_bias": 1, "w13_scale": 2, "w2_scale": 1}
        return {
            param
            for param, n in parts.items()
            if sum(1 for p, _, _ in self._filled if p == param) == n * self.num_local_experts
        }


def place_mxfp4_experts(model: nn.Module, platform: type[Platform]) -> None:
    """Every layer that kept a checkpoint's MXFP4 experts: on `platform`'s kernel that reads them
    (`Platform.pack_moe_mxfp4`), or dequantized to the model's dtype where it has none. Called once the
    weights are loaded, before anything counts the model's bytes."""
    for layer in model.modules():
        if isinstance(layer, FusedMoE) and layer.mxfp4 is not None:
            packed = platform.pack_moe_mxfp4(layer.mxfp4, layer.w13_bias, layer.w2_bias, layer.activation)
            if packed is None:
                layer.dequantize_mxfp4()
            layer.use_packed(packed)


def _moe_reference_eager(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str,
    w13_bias: torch.Tensor | None,
    w2_bias: torch.Tensor | None,
    w13_scale: torch.Tensor | None,
    w2_scale: torch.Tensor | None,
) -> torch.Tensor:
    return fused_experts_reference(
        hidden,
        w13,
        w2,
        topk_weights,
        topk_ids,
        activation=activation,
        w13_bias=w13_bias,
        w2_bias=w2_bias,
        w13_scale=w13_scale,
        w2_scale=w2_scale,
    )


_moe_reference = torch.library.custom_op("pagellm::moe_reference", mutates_args=())(_moe_reference_eager)
"""`fused_experts_reference` as one opaque op under torch.compile: traced, its per-step expert counts would
recompile the graph for every new routing pattern (minutes at start-up, then the recompile limit)."""


@_moe_reference.register_fake
def _(
    hidden, w13, w2, topk_weights, topk_ids, activation, w13_bias, w2_bias, w13_scale, w2_scale
) -> torch.Tensor:
    return hidden.new_empty(hidden.shape[0], w2.shape[1])


def _read(tensor: torch.Tensor | CheckpointSlice, *ranges: tuple[int, int, int]) -> torch.Tensor:
    """`tensor` narrowed along each (dim, start, length); a `CheckpointSlice` reads only that part."""
    if not ranges:
        return tensor.load() if isinstance(tensor, CheckpointSlice) else tensor
    for dim, start, length in ranges:
        if start + length > tensor.shape[dim]:
            raise ConfigError(
                f"a checkpoint expert tensor of shape {tuple(tensor.shape)} has no {start}:{start + length} "
                f"along dimension {dim}; the config does not match the weights"
            )
        tensor = tensor.narrow(dim, start, length)
    return tensor


def _scale_rows(tensor: torch.Tensor | CheckpointSlice, start: int, count: int) -> torch.Tensor:
    """A checkpoint `weight_scale` ([rows, 1], [rows], or one per-tensor value as AutoFP8 writes) as float32
    [count]: rows start..start+count, or the one value spread over them."""
    scale = _read(tensor).float().reshape(-1)
    return scale.expand(count) if scale.numel() == 1 else _read(scale, (0, start, count))


def _copy(target: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    if target.shape != tensor.shape:
        raise ConfigError(
            f"checkpoint tensor experts.{name} gives shape {tuple(tensor.shape)} where the model expects "
            f"{tuple(target.shape)}; the config does not match the weights"
        )
    target.copy_(tensor)


def _parameter(data: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(data, requires_grad=False)
