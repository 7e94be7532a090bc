"""Plain-torch ops of Mamba-2 layers (Granite 4.0-H): the state-space scan in its chunked form (SSD, prefill)
and its one-token form (the selective state update, decode). The causal conv before them is recurrent_ops.py's.

Per head h with head dim P and state size N, the SSM state S is a [P, N] map and each token t does
    S_t = exp(dt_t A) S_{t-1} + dt_t x_t B_t^T;   y_t = S_t C_t + D x_t,
with dt_t = softplus(dt_raw + dt_bias) > 0 and A = -exp(A_log) < 0, so exp(dt_t A) is a decay in (0, 1).
B and C come per group of heads (`n_groups` of them; a group's heads share them).

As in recurrent_ops.py: prefill works on one sequence and returns its new state (a prefill chunk continues
from where the previous one stopped); decode takes B sequences at once and updates their states in place.
Math is in float32 whatever the input dtype, and the state is float32."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def ssd_chunk_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
    chunk_size: int,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
) -> tuple[torch.Tensor, torch.Tensor]:
    """The scan over one sequence's prefill (or prefill chunk), `chunk_size` tokens at a time.

    x [T, H, P] (T >= 1); dt [T, H] before its bias and softplus; A, D, dt_bias [H]; B, C [T, G, N]; state
    [H, P, N] float32, the state before these tokens (zeros for a fresh sequence), read, not written. dt is
    clamped to `dt_limit` after the softplus (here only, not in `selective_state_update`: as transformers and
    mamba_ssm do). Returns (y [T, H, P] in x's dtype, final_state [H, P, N] float32).

    With a_i the cumulative log decay (sum of dt_j A) from a chunk's start S0 to its position i:
        y_i = exp(a_i) S0 C_i + sum_{j<=i} exp(a_i - a_j) (C_i . B_j) dt_j x_j + D x_i,
        S_end = exp(a_C) S0 + sum_j exp(a_C - a_j) dt_j x_j B_j^T.
    Every chunk's in-chunk terms are batched; only the short scan from chunk to chunk is sequential. Only
    differences a_i - a_j with j <= i are exponentiated, so every factor is <= 1."""
    length, heads, _ = x.shape
    per_group = heads // B.shape[1]
    out_dtype = x.dtype
    dt = F.softplus(dt.float() + dt_bias.float()).clamp(dt_limit[0], dt_limit[1])
    chunk = min(chunk_size, length)
    chunks = -(-length // chunk)
    pad = chunks * chunk - length

    def per_chunk(t: torch.Tensor) -> torch.Tensor:
        """[T, H, ...] -> float32 [H, chunks, chunk, ...], zero padded at the end. A padded token has dt = 0,
        so it neither decays the state nor writes to it."""
        t = t.float().transpose(0, 1)
        t = F.pad(t, (0, 0, 0, pad)) if t.dim() == 3 else F.pad(t, (0, pad))
        return t.reshape(heads, chunks, chunk, *t.shape[2:])

    b = per_chunk(B.repeat_interleave(per_group, dim=1))  # [H, n, C, N]
    c = per_chunk(C.repeat_interleave(per_group, dim=1))
    dt = per_chunk(dt)  # [H, n, C]
    x_dt = per_chunk(x) * dt.unsqueeze(-1)  # [H, n, C, P]

    cum = (dt * A.float()[:, None, None]).cumsum(-1)  # [H, n, C]: a_i
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=x.device).tril()
    decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(~causal, float("-inf")).exp()
    y = ((c @ b.transpose(-1, -2)) * decay) @ x_dt  # the in-chunk terms, [H, n, C, P]
    c_decayed = c * cum.exp().unsqueeze(-1)  # reads S0 decayed to position i
    b_to_end = b * (cum[..., -1:] - cum).exp().unsqueeze(-1)  # [H, n, C, N]
    chunk_writes = x_dt.transpose(-1, -2) @ b_to_end  # [H, n, P, N]
    chunk_decay = cum[..., -1].exp()[..., None, None]  # [H, n, 1, 1]

    s = state.float()
    for i in range(chunks):
        y[:, i] += c_decayed[:, i] @ s.transpose(-1, -2)
        s = s * chunk_decay[:, i] + chunk_writes[:, i]

    y = y.reshape(heads, chunks * chunk, -1)[:, :length].transpose(0, 1)
    y = y + x.float() * D.float()[:, None]
    return y.to(out_dtype).contiguous(), s


def selective_state_update(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
) -> torch.Tensor:
    """One decode step for each of B sequences (the recurrence is in the module docstring).

    x [B, H, P]; dt [B, H] before its bias and softplus; A, D, dt_bias [H]; B, C [B, G, N]; state [B, H, P, N]
    float32, updated in place (the state cache's memory; any strides). Returns y [B, H, P] in x's dtype."""
    if state.dtype != torch.float32:
        raise ValueError(f"the SSM state must be float32, got {state.dtype}")
    per_group = x.shape[1] // B.shape[1]
    dt = F.softplus(dt.float() + dt_bias.float())  # [B, H]
    b = B.float().repeat_interleave(per_group, dim=1)  # [B, H, N]
    c = C.float().repeat_interleave(per_group, dim=1)
    state.mul_((dt * A.float()).exp()[..., None, None])
    state.add_((x.float() * dt.unsqueeze(-1)).unsqueeze(-1) * b.unsqueeze(-2))
    y = (state @ c.unsqueeze(-1)).squeeze(-1) + x.float() * D.float()[:, None]
    return y.to(x.dtype)
