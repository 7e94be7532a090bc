"""A platform's kernels for DeepSeek Sparse Attention (`Platform.sparse_attention_kernels`): the lightning
indexer's scores and the attention over the chosen tokens, each reading cached rows in place through their
slots. A field left None runs the torch reference in `pagellm.models.layers.sparse_attention`
(`index_scores`, `attend_selected`), whose docstrings define the math each kernel must match up to float32
summation order:

- `index_scores(q [Q, H, d], rows [N, d], slots [S] int64, weights [Q, H] float32, scale) -> [Q, S]
  float32`: sum_h weights[q, h] * relu(scale * q_h . rows[slots[t]]);
- `attend_rows(q [Q, H, d], rows [N, d], slots [Q, k] int64, valid [Q, k] bool, scale, v_size) ->
  [Q, H, v_size] float32`: softmax over the valid chosen rows of scale * q_h . row, times the rows' first
  v_size values.

`rows` is a slot-major cache of float32 or bfloat16 rows (other cache dtypes run the references), q the
model's float32 or bfloat16 queries; products and sums in float32."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

ROW_DTYPES = (torch.float32, torch.bfloat16)
"""Cache dtypes the kernels read."""


@dataclass(frozen=True)
class SparseAttentionKernels:
    index_scores: Callable[..., torch.Tensor] | None = None
    attend_rows: Callable[..., torch.Tensor] | None = None
