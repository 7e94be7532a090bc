"""`Embedding`: a lookup table created uninitialised (the checkpoint fills it), unlike nn.Embedding.

With tensor parallelism each rank holds rows [start, start + rows) of a vocabulary padded to a multiple of
the ranks; ids outside them look up zeros and the ranks' rows are summed (vLLM's VocabParallelEmbedding).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.distributed import Group
from pagellm.models.layers.linear import narrow_padded


class Embedding(nn.Module):
    def __init__(self, num_embeddings: int, dim: int, dtype: torch.dtype, group: Group | None = None):
        super().__init__()
        self.num_embeddings = num_embeddings
        self.group = group if group is not None and group.size > 1 else None
        rows = -(-num_embeddings // group.size) if self.group else num_embeddings
        self.start = rows * group.rank if self.group else 0
        self.weight = nn.Parameter(torch.empty(rows, dim, dtype=dtype), requires_grad=False)
        self.lookup: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
        self.block_type: int | None = None

    def use_packed_table(
        self,
        table: torch.Tensor,
        lookup: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        block_type: int | None = None,
    ) -> None:
        """Keep the table only as `table` (a buffer, counted and moved like the weight was), read by
        `lookup(ids, table)`: a quantization method's packed rows (GGUF blocks, of GGML type `block_type`,
        which a native decode step reads itself)."""
        self.register_buffer("packed_table", table, persistent=False)
        self.lookup = lookup
        self.block_type = block_type
        self.weight = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.lookup is not None:
            return self.lookup(ids, self.packed_table)
        if self.group is None:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return self.group.all_reduce(out)

    def narrow_checkpoint(self, attr: str, tensor: torch.Tensor, part: int | None) -> torch.Tensor:
        """This rank's rows of the checkpoint's table (zeros past the vocabulary's end)."""
        if self.group is None:
            return tensor
        return narrow_padded(tensor, 0, self.start, self.weight.shape[0])
