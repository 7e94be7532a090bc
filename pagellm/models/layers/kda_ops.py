"""Plain-torch ops of Kimi delta attention (KDA, Kimi Linear): the gated delta rule with a decay per key
channel instead of one per head.

Per head and token t, with S a [Dk, Dv] map from keys to values and g_t [Dk] the log decay of each key
channel (<= 0):
    S' = diag(exp(g_t)) S;  d_t = beta_t (v_t - S'^T k_t);  S = S' + k_t d_t^T;  o_t = S^T q_t,
q and k L2-normalised (eps inside the root, as fla) and q scaled by Dk**-0.5, in float32 whatever the input
dtype, as transformers' `recurrent_kimi_delta_attention` computes it. A per-head decay (Gated DeltaNet,
recurrent_ops.py) makes every key channel decay alike, which its chunked form relies on; here prefill runs
the same step token by token (no chunked form yet), decode one step for a batch of sequences."""

from __future__ import annotations

import torch

from pagellm.models.layers.recurrent_ops import (
    delta_rule_step,
    prepare_delta_inputs,
    recurrent_channel_gated_delta_rule,
)


def kda_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule over one sequence's new tokens, continuing from `state`.

    q, k [T, H, Dk]; v [T, H, Dv]; g [T, H, Dk] log decay; beta [T, H]; state [H, Dk, Dv] float32, read,
    not written (it may be a view into the state cache). Returns (o [T, H, Dv] in v's dtype, the new
    state [H, Dk, Dv] float32)."""
    dtype = v.dtype
    q, k, v, g, beta = prepare_delta_inputs(q, k, v, g, beta)
    s = state.float().clone().unsqueeze(0)  # [1, H, Dk, Dv]
    out = torch.empty_like(v)
    for t in range(q.shape[0]):
        rows = slice(t, t + 1)
        out[rows] = delta_rule_step(q[rows], k[rows], v[rows], g[rows], beta[rows], s)
    return out.to(dtype), s[0]


kda_decode = recurrent_channel_gated_delta_rule
"""One new token for each of B sequences: q, k [B, H, Dk], v [B, H, Dv], g [B, H, Dk], beta [B, H]; state
[B, H, Dk, Dv] float32, updated in place. Returns o [B, H, Dv] in v's dtype."""
