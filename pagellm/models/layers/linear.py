"""`Linear`: the one linear layer every model uses, so a quantization method can replace its weights."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.core.errors import ConfigError
from pagellm.core.platform import PackedLinear
from pagellm.core.quant import QuantMethod
from pagellm.distributed import Group
from pagellm.models.context import lora_batch


@dataclass(frozen=True)
class Shard:
    """The part of the checkpoint's tensor this rank's layer holds (tensor parallelism).

    dim 0 (column parallel): `slices[i]` = (start, length) of fused part i's output rows. dim 1 (row
    parallel): `slices[0]` = (start, length) of the input columns; the bias is whole, added once after the
    all-reduce. Rows past the checkpoint's end (a vocabulary padded to a multiple of the ranks) are zeros."""

    dim: int
    slices: tuple[tuple[int, int], ...]


@dataclass
class LoRAWeights:
    """Per-slot LoRA matrices of one layer, slot s in rows s * width .. (s + 1) * width of both (filled by
    `pagellm.lora.manager.LoRAManager`)."""

    a: torch.Tensor  # [slots x width, in]; width = shards x max_rank
    b: torch.Tensor  # [slots x width, out]: B transposed, block-diagonal over shards, scaling folded in
    width: int


class Linear(nn.Module):
    """y = x W^T + b. With a quant method, the method owns the weight parameters and the matmul.

    A fused layer (q/k/v, gate/up) stacks several checkpoint tensors along the output dimension;
    `output_sizes` lists their sizes and `load_shard` copies one into its rows.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        dtype: torch.dtype,
        quant_method: QuantMethod | None = None,
        output_sizes: list[int] | None = None,
        shard: Shard | None = None,
        reduce: Group | None = None,
    ):
        """`shard`: this rank's part of the checkpoint tensors (sizes above are the rank's own);
        `reduce`: the group whose partial sums are added (row parallel)."""
        super().__init__()
        self.shard = shard
        self.reduce = reduce if reduce is not None and reduce.size > 1 else None
        self.in_features = in_features
        self.out_features = out_features
        self.output_sizes = output_sizes or [out_features]
        self.quant_method = quant_method
        if quant_method is not None:
            quant_method.create_weights(self, in_features, out_features, dtype)
        else:
            self.weight = _parameter(torch.empty(out_features, in_features, dtype=dtype))
        self.bias = _parameter(torch.empty(out_features, dtype=dtype)) if bias else None
        self.packed_matmul: (
            Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor] | None
        ) = None
        """The platform's matmul for `packed_weight` (`Platform.pack_linear`), set after loading."""
        self.lora: LoRAWeights | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias if self.reduce is None else None  # a row-parallel bias is added once, after the sum
        if self.quant_method is not None:
            y = self.quant_method.apply(self, x, bias)
        elif self.packed_matmul is not None:
            y = self.packed_matmul(x, self.packed_weight, bias)
        else:
            y = F.linear(x, self.weight, bias)
        if self.reduce is not None:
            y = self.reduce.all_reduce(y)
            if self.bias is not None:
                y = y + self.bias
        batch = lora_batch() if self.lora is not None else None
        if batch is not None:  # the adapter tokens: y += (x A_slot^T) B_slot^T, all slots at once
            shrunk = (x.index_select(0, batch.rows) @ self.lora.a.T) * batch.mask(self.lora.width, x.dtype)
            y.index_add_(0, batch.rows, (shrunk @ self.lora.b).to(y.dtype))
        return y

    def use_packed(self, packed: PackedLinear | None) -> None:
        """Keep the weight only in the platform's packed layout (a buffer, so it is counted and moved like
        the weight was) and multiply with its matmul. None: keep the plain weight and F.linear."""
        if packed is not None:
            self.register_buffer("packed_weight", packed.weight, persistent=False)
            self.packed_matmul = packed.matmul
            self.weight = None

    def narrow_checkpoint(self, attr: str, tensor: torch.Tensor, part: int | None) -> torch.Tensor:
        """This rank's slice of checkpoint tensor `attr` (fused part `part`); the whole tensor without a
        shard. Called by the loader before it copies."""
        if self.shard is None or (self.shard.dim == 1 and attr == "bias"):
            return tensor
        start, length = self.shard.slices[part or 0]
        return narrow_padded(tensor, self.shard.dim, start, length)

    def load_shard(self, param: nn.Parameter, tensor: torch.Tensor, shard: int) -> None:
        """Copy checkpoint tensor `shard` of a fused layer into its slice of `param`.

        The slice is taken along `param.output_dim` (default 0) and scaled to the parameter's size there,
        so packed formats (several values per element) slice correctly too."""
        dim = getattr(param, "output_dim", 0)
        scale = param.shape[dim] / self.out_features
        start = int(sum(self.output_sizes[:shard]) * scale)
        size = int(self.output_sizes[shard] * scale)
        target = param.data.narrow(dim, start, size)
        if target.shape != tensor.shape:
            raise ConfigError(
                f"fused shard {shard} has checkpoint shape {tuple(tensor.shape)}, the model expects "
                f"{tuple(target.shape)}; the config does not match the weights"
            )
        target.copy_(tensor)


def narrow_padded(tensor: torch.Tensor, dim: int, start: int, length: int) -> torch.Tensor:
    """tensor.narrow(dim, start, length), with zeros where the range runs past the tensor's end."""
    available = max(0, min(length, tensor.shape[dim] - start))
    part = tensor.narrow(dim, min(start, tensor.shape[dim]), available)
    if available == length:
        return part
    shape = list(tensor.shape)
    shape[dim] = length - available
    return torch.cat([part, part.new_zeros(shape)], dim=dim)


def _parameter(data: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(data, requires_grad=False)
