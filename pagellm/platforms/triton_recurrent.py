"""The recurrent layers' kernels in Triton, for CUDA and ROCm devices: what `recurrent_kernels` returns there
(`pagellm.core.state.RecurrentKernels` gives each one's signature and layout; the plain-torch references in
`pagellm.models.layers.recurrent_ops` / `mamba_ops` define the math, and the tests compare against them).

Decode kernels run one program per (sequence, head, block of value columns) (the conv: per sequence and block
of channels). A program finds its sequence's slot in the state cache, reads that slot's state once, updates it
in registers and writes it back in place: no gather into a batch and scatter back, as the reference does.
Every tensor is addressed through its strides, so the layers' split views and the cache's slot views are
read where they lie. No host synchronisation, so decode steps can be captured in CUDA graphs.

Prefill kernels are chunked: one program per (head, block of value columns) walks the sequence a chunk of
`CHUNK` tokens at a time, carrying the state in registers; within a chunk the work is matrix products (the
in-chunk terms of the references' chunked forms, see their docstrings), and only the walk from chunk to chunk
is sequential. The gated delta rule's unit lower-triangular system is inverted in the program, a row at a
time. Unlike fla's and mamba_ssm's kernels, which spread a sequence's chunks over programs and so need
several launches, this is one launch and its parallelism is heads x value blocks; it is exact (the result
does not depend on the chunk beyond rounding), which is what a prefill chunk of a few thousand tokens needs.

All arithmetic is float32 whatever the input dtype (products in IEEE float32, not TF32), as the references
do; outputs are rounded once to the input's dtype. The kernels are jitted on first use in each interpreter
mode, so calls made while `TRITON_INTERPRET=1` is set run them on CPU tensors (tests), the others compiled.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch

from pagellm.core.state import RecurrentKernels
from pagellm.core.triton_language import bind_triton_language

tl = None  # triton.language once a kernel is needed (`bind_triton_language`)

L2NORM_EPS = 1e-6
"""Inside the root of q's and k's L2 norm, as the reference (and transformers, fla) computes it."""
SOFTPLUS_THRESHOLD = 20.0
"""softplus(x) = x above this, as torch's F.softplus does."""
CHUNK = 32
"""Tokens per chunk of the prefill kernels: a [CHUNK, CHUNK] block and a few [CHUNK, head dim] tiles live in
registers beside the state, and tl.dot needs at least 16."""
DECODE_VALUE_BLOCK = 64
PREFILL_VALUE_BLOCK = 32
CONV_CHANNEL_BLOCK = 256
CONV_TOKEN_BLOCK = 16
ACTIVATIONS = (None, "silu", "swish")
"""The conv's activations the kernels apply: none, or silu (transformers' configs also call it swish)."""


def _pow2(n: int, least: int = 16) -> int:
    """A block covering n: the next power of two, at least `least` (tl.dot's smallest operand side)."""
    return max(1 << max(n - 1, 0).bit_length(), least)


def _check_activation(activation: str | None) -> bool:
    if activation not in ACTIVATIONS:
        raise ValueError(f"the Triton conv applies silu or no activation, not {activation!r}")
    return activation is not None


def conv1d_update(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_states: torch.Tensor,
    slots: torch.Tensor,
    activation: str | None,
) -> torch.Tensor:
    """One token of B sequences through the causal depthwise conv: x [B, D], weight [D, K], conv_states
    [S, D, K-1] (the slots' rows shifted left by one and x appended, in place). Returns y [B, D]."""
    silu = _check_activation(activation)
    batch, channels = x.shape
    y = x.new_empty(batch, channels)
    if batch == 0:
        return y
    block_d = min(_pow2(channels), CONV_CHANNEL_BLOCK)
    grid = (batch, -(-channels // block_d))
    _kernels().conv_update[grid](
        x, weight, bias, conv_states, slots, y, channels,
        x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), *conv_states.stride(),
        WIDTH=weight.shape[1], HAS_BIAS=bias is not None, SILU=silu, BLOCK_D=block_d,
        BLOCK_K=_pow2(weight.shape[1], 2),
    )  # fmt: skip
    return y


def causal_conv1d_prefill(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    state: torch.Tensor,
    activation: str | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's T new tokens x [T, D] through the conv, continuing from state [D, K-1] (read, not
    written). Returns (y [T, D] in x's dtype, new_state [D, K-1] in state's dtype): the reference's contract."""
    silu = _check_activation(activation)
    length, channels = x.shape
    width = weight.shape[1]
    y = x.new_empty(length, channels)
    new_state = state.new_empty(channels, width - 1)
    block_d = min(_pow2(channels), CONV_CHANNEL_BLOCK)
    grid = (-(-length // CONV_TOKEN_BLOCK), -(-channels // block_d))
    _kernels().conv_prefill[grid](
        x, weight, bias, state, y, new_state, length, channels,
        x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), state.stride(0), state.stride(1),
        WIDTH=width, HAS_BIAS=bias is not None, SILU=silu, BLOCK_T=CONV_TOKEN_BLOCK, BLOCK_D=block_d,
        BLOCK_K=_pow2(width - 1, 2),
    )  # fmt: skip
    return y, new_state


def gated_delta_rule_update(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """One decode step of the gated delta rule for B sequences: q, k [B, H, Dk]; v [B, H, Dv]; g, beta
    [B, H]; states [S, H, Dk, Dv] float32, the slots' states updated in place. Returns o [B, H, Dv]."""
    if states.dtype != torch.float32:
        raise ValueError(f"the recurrent state must be float32, got {states.dtype}")
    batch, heads, dk = k.shape
    dv = v.shape[-1]
    out = v.new_empty(batch, heads, dv)
    if batch == 0:
        return out
    block_v = min(_pow2(dv), DECODE_VALUE_BLOCK)
    grid = (batch, heads, -(-dv // block_v))
    _kernels().delta_update[grid](
        q, k, v, g, beta, states, slots, out, dk, dv,
        *q.stride(), *k.stride(), *v.stride(), *g.stride(), *beta.stride(), *states.stride(),
        SCALE=dk**-0.5, EPS=L2NORM_EPS, BLOCK_K=_pow2(dk), BLOCK_V=block_v,
    )  # fmt: skip
    return out


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over one sequence's T tokens (the reference's signature and contract): q, k
    [T, H, Dk]; v [T, H, Dv]; g, beta [T, H]; state [H, Dk, Dv] float32, read, not written. Returns (o
    [T, H, Dv] in v's dtype, final_state [H, Dk, Dv] float32). The kernel's chunk is `CHUNK` tokens whatever
    `chunk_size` says (the reference's, kept for its signature): registers bound it, and the result does not
    depend on it beyond rounding."""
    if state.dtype != torch.float32:
        raise ValueError(f"the recurrent state must be float32, got {state.dtype}")
    length, heads, dk = k.shape
    dv = v.shape[-1]
    out = v.new_empty(length, heads, dv)
    final = torch.empty(heads, dk, dv, dtype=torch.float32, device=v.device)
    block_v = min(_pow2(dv), PREFILL_VALUE_BLOCK)
    grid = (heads, -(-dv // block_v))
    _kernels().delta_chunk[grid](
        q, k, v, g, beta, state, out, final, length, dk, dv,
        *q.stride(), *k.stride(), *v.stride(), *g.stride(), *beta.stride(), *state.stride(),
        SCALE=dk**-0.5, EPS=L2NORM_EPS, BLOCK_T=CHUNK, BLOCK_K=_pow2(dk), BLOCK_V=block_v,
    )  # fmt: skip
    return out, final


def selective_state_update(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    dt_bias: torch.Tensor,
    states: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """One Mamba-2 decode step for B sequences: x [B, H, P]; dt [B, H] before its bias and softplus (not
    clamped, as the reference); A, D, dt_bias [H]; B, C [B, G, N]; states [S, H, P, N] float32, the slots'
    states updated in place. Returns y [B, H, P]."""
    if states.dtype != torch.float32:
        raise ValueError(f"the SSM state must be float32, got {states.dtype}")
    batch, heads, head_dim = x.shape
    groups, d_state = B.shape[1:]
    y = x.new_empty(batch, heads, head_dim)
    if batch == 0:
        return y
    block_p = min(_pow2(head_dim), DECODE_VALUE_BLOCK)
    grid = (batch, heads, -(-head_dim // block_p))
    _kernels().ssm_update[grid](
        x, dt, A.contiguous(), B, C, D.contiguous(), dt_bias.contiguous(), states, slots, y, head_dim, d_state,
        *x.stride(), *dt.stride(), *B.stride(), *C.stride(), *states.stride(),
        HEADS_PER_GROUP=heads // groups, THRESHOLD=SOFTPLUS_THRESHOLD, BLOCK_P=block_p, BLOCK_N=_pow2(d_state),
    )  # fmt: skip
    return y


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
    """The Mamba-2 scan over one sequence's T tokens (the reference's signature and contract): x [T, H, P];
    dt [T, H] before its bias and softplus, clamped to `dt_limit` after it; A, D, dt_bias [H]; B, C [T, G, N];
    state [H, P, N] float32, read, not written. Returns (y [T, H, P] in x's dtype, final_state [H, P, N]
    float32). As in `chunk_gated_delta_rule`, the kernel's chunk is `CHUNK` whatever `chunk_size` says."""
    if state.dtype != torch.float32:
        raise ValueError(f"the SSM state must be float32, got {state.dtype}")
    length, heads, head_dim = x.shape
    groups, d_state = B.shape[1:]
    y = x.new_empty(length, heads, head_dim)
    final = torch.empty(heads, head_dim, d_state, dtype=torch.float32, device=x.device)
    block_p = min(_pow2(head_dim), PREFILL_VALUE_BLOCK)
    grid = (heads, -(-head_dim // block_p))
    _kernels().ssd_chunk[grid](
        x, dt, A.contiguous(), B, C, D.contiguous(), dt_bias.contiguous(), state, y, final, length, head_dim,
        d_state, float(dt_limit[0]), float(dt_limit[1]),
        *x.stride(), *dt.stride(), *B.stride(), *C.stride(), *state.stride(),
        HEADS_PER_GROUP=heads // groups, THRESHOLD=SOFTPLUS_THRESHOLD, BLOCK_T=CHUNK, BLOCK_P=block_p,
        BLOCK_N=_pow2(d_state),
    )  # fmt: skip
    return y, final


TRITON_RECURRENT_KERNELS = RecurrentKernels(
    conv1d_update=conv1d_update,
    gated_delta_rule_update=gated_delta_rule_update,
    selective_state_update=selective_state_update,
    causal_conv1d_prefill=causal_conv1d_prefill,
    chunk_gated_delta_rule=chunk_gated_delta_rule,
    ssd_chunk_scan=ssd_chunk_scan,
)
"""Every recurrent kernel in Triton: what CUDA and ROCm platforms return where triton is installed."""


def _interpreting() -> bool:
    import triton

    return bool(triton.knobs.runtime.interpret)


def _kernels() -> SimpleNamespace:
    """The kernels for the current interpreter mode: `triton.jit` picks interpreted or compiled when it wraps
    a function, so kernels cached once would run a whole process in the mode of their first call."""
    return _kernels_in_mode(_interpreting())


@functools.cache
def _kernels_in_mode(interpreting: bool) -> SimpleNamespace:
    import triton

    bind_triton_language(globals())
    return SimpleNamespace(
        conv_update=triton.jit(_conv_update),
        conv_prefill=triton.jit(_conv_prefill),
        delta_update=triton.jit(_delta_update),
        delta_chunk=triton.jit(_delta_chunk),
        ssm_update=triton.jit(_ssm_update),
        ssd_chunk=triton.jit(_ssd_chunk),
    )


# Only core builtins in the kernels: tl.zeros, tl.sum, tl.cumsum and tl.sigmoid are jit functions, which the
# interpreter cannot call if triton was imported before TRITON_INTERPRET was set; tl.reduce and
# tl.associative_scan with the combine function tl.sum and tl.cumsum pass are what they run (the interpreter
# maps those to numpy).


def _conv_update(
    x_ptr, w_ptr, bias_ptr, states_ptr, slots_ptr, y_ptr, D,
    stride_x_b, stride_x_d, stride_w_d, stride_w_k, stride_s_slot, stride_s_d, stride_s_k,
    WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """y[b, d] for one sequence and block of channels: the window is the slot's K-1 inputs then x, and the
    slot's row becomes the window's last K-1 columns."""
    b = tl.program_id(0)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = d < D
    taps = tl.arange(0, BLOCK_K)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    x = tl.load(x_ptr + b * stride_x_b + d * stride_x_d, mask=d_ok, other=0.0)
    row = states_ptr + slot * stride_s_slot + d[:, None] * stride_s_d + taps[None, :] * stride_s_k
    in_state = d_ok[:, None] & (taps < WIDTH - 1)[None, :]
    window = tl.load(row, mask=in_state, other=0.0).to(tl.float32)
    window = tl.where(taps[None, :] == WIDTH - 1, x.to(tl.float32)[:, None], window)
    w_mask = d_ok[:, None] & (taps < WIDTH)[None, :]
    w = tl.load(w_ptr + d[:, None] * stride_w_d + taps[None, :] * stride_w_k, mask=w_mask, other=0.0)
    y = tl.reduce(window * w.to(tl.float32), 1, tl.standard._sum_combine)
    if HAS_BIAS:
        y += tl.load(bias_ptr + d, mask=d_ok, other=0.0).to(tl.float32)
    if SILU:
        y = y / (1.0 + tl.exp(-y))
    tl.store(y_ptr + b * D + d, y.to(y_ptr.dtype.element_ty), mask=d_ok)
    shifted = tl.load(row + stride_s_k, mask=d_ok[:, None] & (taps < WIDTH - 2)[None, :], other=0.0)
    shifted = tl.where(taps[None, :] == WIDTH - 2, x.to(states_ptr.dtype.element_ty)[:, None], shifted)
    tl.debug_barrier()  # every thread has read the row before any writes it: the shift reads what it moves
    tl.store(row, shifted, mask=in_state)


def _conv_prefill(
    x_ptr, w_ptr, bias_ptr, state_ptr, y_ptr, new_state_ptr, T, D,
    stride_x_t, stride_x_d, stride_w_d, stride_w_k, stride_s_d, stride_s_k,
    WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """y for one block of tokens and channels; input i of the sequence (state ++ x) is state column i while
    i < K-1, else x row i - (K-1). The first token block also writes the new state, inputs T .. T+K-2."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = d < D
    y = tl.full((BLOCK_T, BLOCK_D), 0.0, dtype=tl.float32)
    for tap in tl.static_range(WIDTH):
        src = t + tap - (WIDTH - 1)  # the input's row in x; below 0: in the state
        from_x = tl.load(
            x_ptr + src[:, None] * stride_x_t + d[None, :] * stride_x_d,
            mask=((src >= 0) & (t < T))[:, None] & d_ok[None, :],
            other=0.0,
        ).to(tl.float32)
        from_state = tl.load(
            state_ptr + d[None, :] * stride_s_d + (src + WIDTH - 1)[:, None] * stride_s_k,
            mask=((src < 0) & (t < T))[:, None] & d_ok[None, :],
            other=0.0,
        ).to(tl.float32)
        w = tl.load(w_ptr + d * stride_w_d + tap * stride_w_k, mask=d_ok, other=0.0).to(tl.float32)
        y += (from_x + from_state) * w[None, :]
    if HAS_BIAS:
        y += tl.load(bias_ptr + d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    if SILU:
        y = y / (1.0 + tl.exp(-y))
    tl.store(
        y_ptr + t[:, None] * D + d[None, :],
        y.to(y_ptr.dtype.element_ty),
        mask=(t < T)[:, None] & d_ok[None, :],
    )
    if tl.program_id(0) == 0:
        cols = tl.arange(0, BLOCK_K)
        src = T + cols - (WIDTH - 1)
        col_ok = cols < WIDTH - 1
        from_x = tl.load(
            x_ptr + src[None, :] * stride_x_t + d[:, None] * stride_x_d,
            mask=d_ok[:, None] & (col_ok & (src >= 0))[None, :],
            other=0.0,
        ).to(new_state_ptr.dtype.element_ty)
        from_state = tl.load(
            state_ptr + d[:, None] * stride_s_d + (src + WIDTH - 1)[None, :] * stride_s_k,
            mask=d_ok[:, None] & (col_ok & (src < 0))[None, :],
            other=0.0,
        ).to(new_state_ptr.dtype.element_ty)
        tl.store(
            new_state_ptr + d[:, None] * (WIDTH - 1) + cols[None, :],
            tl.where((src >= 0)[None, :], from_x, from_state),
            mask=d_ok[:, None] & col_ok[None, :],
        )


def _delta_update(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, states_ptr, slots_ptr, o_ptr, DK, DV,
    stride_q_b, stride_q_h, stride_q_d, stride_k_b, stride_k_h, stride_k_d, stride_v_b, stride_v_h, stride_v_d,
    stride_g_b, stride_g_h, stride_beta_b, stride_beta_h,
    stride_s_slot, stride_s_h, stride_s_k, stride_s_v,
    SCALE: tl.constexpr, EPS: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    """One sequence's step in one head, for one block of value columns (the columns of S are independent:
    each reads all of k and q, which the program normalises itself)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    heads = tl.num_programs(1)
    kd = tl.arange(0, BLOCK_K)
    kd_ok = kd < DK
    vd = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    vd_ok = vd < DV
    slot = tl.load(slots_ptr + b).to(tl.int64)
    q = tl.load(q_ptr + b * stride_q_b + h * stride_q_h + kd * stride_q_d, mask=kd_ok, other=0.0).to(
        tl.float32
    )
    k = tl.load(k_ptr + b * stride_k_b + h * stride_k_h + kd * stride_k_d, mask=kd_ok, other=0.0).to(
        tl.float32
    )
    v = tl.load(v_ptr + b * stride_v_b + h * stride_v_h + vd * stride_v_d, mask=vd_ok, other=0.0).to(
        tl.float32
    )
    q = q * tl.rsqrt(tl.reduce(q * q, 0, tl.standard._sum_combine) + EPS) * SCALE
    k = k * tl.rsqrt(tl.reduce(k * k, 0, tl.standard._sum_combine) + EPS)
    decay = tl.exp(tl.load(g_ptr + b * stride_g_b + h * stride_g_h).to(tl.float32))
    beta = tl.load(beta_ptr + b * stride_beta_b + h * stride_beta_h).to(tl.float32)
    s_ptrs = (
        states_ptr
        + slot * stride_s_slot
        + h * stride_s_h
        + kd[:, None] * stride_s_k
        + vd[None, :] * stride_s_v
    )
    s_mask = kd_ok[:, None] & vd_ok[None, :]
    s = tl.load(s_ptrs, mask=s_mask, other=0.0) * decay
    predicted = tl.reduce(s * k[:, None], 0, tl.standard._sum_combine)  # S'^T k
    s += k[:, None] * ((v - predicted) * beta)[None, :]
    o = tl.reduce(s * q[:, None], 0, tl.standard._sum_combine)
    tl.store(s_ptrs, s, mask=s_mask)
    tl.store(o_ptr + (b * heads + h) * DV + vd, o.to(o_ptr.dtype.element_ty), mask=vd_ok)


def _delta_chunk(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, o_ptr, final_ptr, T, DK, DV,
    stride_q_t, stride_q_h, stride_q_d, stride_k_t, stride_k_h, stride_k_d, stride_v_t, stride_v_h, stride_v_d,
    stride_g_t, stride_g_h, stride_beta_t, stride_beta_h, stride_s_h, stride_s_k, stride_s_v,
    SCALE: tl.constexpr, EPS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    """One head's sequence, for one block of value columns, a chunk at a time (`chunk_gated_delta_rule`'s
    reference docstring derives the chunk's terms). Tokens past T load as k = 0, beta = 0, g = 0: they write
    nothing and decay nothing."""
    h = tl.program_id(0)
    heads = tl.num_programs(0)
    kd = tl.arange(0, BLOCK_K)
    kd_ok = kd < DK
    vd = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    vd_ok = vd < DV
    rows = tl.arange(0, BLOCK_T)
    causal = rows[:, None] >= rows[None, :]
    strict = rows[:, None] > rows[None, :]
    identity = tl.where(rows[:, None] == rows[None, :], 1.0, 0.0)
    s_offsets = h * stride_s_h + kd[:, None] * stride_s_k + vd[None, :] * stride_s_v
    s_mask = kd_ok[:, None] & vd_ok[None, :]
    s = tl.load(state_ptr + s_offsets, mask=s_mask, other=0.0)
    for start in range(0, T, BLOCK_T):
        t = start + rows
        t_ok = t < T
        qk_mask = t_ok[:, None] & kd_ok[None, :]
        q = tl.load(
            q_ptr + t[:, None] * stride_q_t + h * stride_q_h + kd[None, :] * stride_q_d,
            mask=qk_mask,
            other=0.0,
        ).to(tl.float32)
        k = tl.load(
            k_ptr + t[:, None] * stride_k_t + h * stride_k_h + kd[None, :] * stride_k_d,
            mask=qk_mask,
            other=0.0,
        ).to(tl.float32)
        v = tl.load(
            v_ptr + t[:, None] * stride_v_t + h * stride_v_h + vd[None, :] * stride_v_d,
            mask=t_ok[:, None] & vd_ok[None, :],
            other=0.0,
        ).to(tl.float32)
        g = tl.load(g_ptr + t * stride_g_t + h * stride_g_h, mask=t_ok, other=0.0).to(tl.float32)
        beta = tl.load(beta_ptr + t * stride_beta_t + h * stride_beta_h, mask=t_ok, other=0.0).to(tl.float32)
        q = q * tl.rsqrt(tl.reduce(q * q, 1, tl.standard._sum_combine) + EPS)[:, None] * SCALE
        k = k * tl.rsqrt(tl.reduce(k * k, 1, tl.standard._sum_combine) + EPS)[:, None]
        cum = tl.associative_scan(g, 0, tl.standard._sum_combine)  # G_i
        total = tl.reduce(g, 0, tl.standard._sum_combine)  # G at the chunk's end (padding adds 0)
        # exp(G_i - G_j) for j <= i, 0 above the diagonal (masked before exp: G_i - G_j > 0 there)
        decay = tl.where(causal, tl.exp(tl.where(causal, cum[:, None] - cum[None, :], 0.0)), 0.0)
        k_beta = k * beta[:, None]
        system = tl.where(strict, tl.dot(k_beta, tl.trans(k), input_precision="ieee") * decay, 0.0)  # A
        # (I + A)^-1 by forward substitution: row i is e_i - sum_{j<i} A_ij (row j); rows j >= i are
        # still the identity's but A_ij = 0 there
        inverse = identity
        for i in range(1, BLOCK_T):
            a_row = tl.reduce(tl.where(rows[:, None] == i, system, 0.0), 0, tl.standard._sum_combine)
            row = tl.where(rows == i, 1.0, -tl.reduce(a_row[:, None] * inverse, 0, tl.standard._sum_combine))
            inverse = tl.where(rows[:, None] == i, row[None, :], inverse)
        # d = (I + A)^-1 (beta v - beta exp(G) K S0): the chunk's corrections
        rhs = v * beta[:, None] - tl.dot(k_beta * tl.exp(cum)[:, None], s, input_precision="ieee")
        d = tl.dot(inverse, rhs, input_precision="ieee")
        attn = tl.dot(q, tl.trans(k), input_precision="ieee") * decay
        o = tl.dot(q * tl.exp(cum)[:, None], s, input_precision="ieee") + tl.dot(
            attn, d, input_precision="ieee"
        )
        tl.store(
            o_ptr + (t[:, None] * heads + h) * DV + vd[None, :],
            o.to(o_ptr.dtype.element_ty),
            mask=t_ok[:, None] & vd_ok[None, :],
        )
        k_to_end = k * tl.exp(total - cum)[:, None]
        s = s * tl.exp(total) + tl.dot(tl.trans(k_to_end), d, input_precision="ieee")
    tl.store(final_ptr + h * DK * DV + kd[:, None] * DV + vd[None, :], s, mask=s_mask)


def _ssm_update(
    x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, dt_bias_ptr, states_ptr, slots_ptr, y_ptr, P, N,
    stride_x_b, stride_x_h, stride_x_p, stride_dt_b, stride_dt_h, stride_B_b, stride_B_g, stride_B_n,
    stride_C_b, stride_C_g, stride_C_n, stride_s_slot, stride_s_h, stride_s_p, stride_s_n,
    HEADS_PER_GROUP: tl.constexpr, THRESHOLD: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """One sequence's step in one head, for one block of the head's P rows of S."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    heads = tl.num_programs(1)
    group = h // HEADS_PER_GROUP
    p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    p_ok = p < P
    n = tl.arange(0, BLOCK_N)
    n_ok = n < N
    slot = tl.load(slots_ptr + b).to(tl.int64)
    dt = tl.load(dt_ptr + b * stride_dt_b + h * stride_dt_h).to(tl.float32) + tl.load(dt_bias_ptr + h).to(
        tl.float32
    )
    dt = tl.where(dt > THRESHOLD, dt, tl.log(1.0 + tl.exp(tl.minimum(dt, THRESHOLD))))  # softplus
    decay = tl.exp(dt * tl.load(A_ptr + h).to(tl.float32))
    x = tl.load(x_ptr + b * stride_x_b + h * stride_x_h + p * stride_x_p, mask=p_ok, other=0.0).to(tl.float32)
    B = tl.load(B_ptr + b * stride_B_b + group * stride_B_g + n * stride_B_n, mask=n_ok, other=0.0).to(
        tl.float32
    )
    C = tl.load(C_ptr + b * stride_C_b + group * stride_C_g + n * stride_C_n, mask=n_ok, other=0.0).to(
        tl.float32
    )
    s_ptrs = (
        states_ptr + slot * stride_s_slot + h * stride_s_h + p[:, None] * stride_s_p + n[None, :] * stride_s_n
    )
    s_mask = p_ok[:, None] & n_ok[None, :]
    s = tl.load(s_ptrs, mask=s_mask, other=0.0) * decay + (x * dt)[:, None] * B[None, :]
    tl.store(s_ptrs, s, mask=s_mask)
    y = tl.reduce(s * C[None, :], 1, tl.standard._sum_combine) + x * tl.load(D_ptr + h).to(tl.float32)
    tl.store(y_ptr + (b * heads + h) * P + p, y.to(y_ptr.dtype.element_ty), mask=p_ok)


def _ssd_chunk(
    x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, dt_bias_ptr, state_ptr, y_ptr, final_ptr, T, P, N, dt_min, dt_max,
    stride_x_t, stride_x_h, stride_x_p, stride_dt_t, stride_dt_h, stride_B_t, stride_B_g, stride_B_n,
    stride_C_t, stride_C_g, stride_C_n, stride_s_h, stride_s_p, stride_s_n,
    HEADS_PER_GROUP: tl.constexpr, THRESHOLD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    """One head's sequence, for one block of its P rows of S, a chunk at a time (`ssd_chunk_scan`'s
    reference docstring gives the chunk's terms). Tokens past T get dt = 0: they write nothing and decay
    nothing."""
    h = tl.program_id(0)
    heads = tl.num_programs(0)
    group = h // HEADS_PER_GROUP
    p = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
    p_ok = p < P
    n = tl.arange(0, BLOCK_N)
    n_ok = n < N
    rows = tl.arange(0, BLOCK_T)
    causal = rows[:, None] >= rows[None, :]
    a = tl.load(A_ptr + h).to(tl.float32)
    bias = tl.load(dt_bias_ptr + h).to(tl.float32)
    skip = tl.load(D_ptr + h).to(tl.float32)
    s_mask = p_ok[:, None] & n_ok[None, :]
    s = tl.load(
        state_ptr + h * stride_s_h + p[:, None] * stride_s_p + n[None, :] * stride_s_n, mask=s_mask, other=0.0
    )
    for start in range(0, T, BLOCK_T):
        t = start + rows
        t_ok = t < T
        dt = tl.load(dt_ptr + t * stride_dt_t + h * stride_dt_h, mask=t_ok, other=0.0).to(tl.float32) + bias
        dt = tl.where(dt > THRESHOLD, dt, tl.log(1.0 + tl.exp(tl.minimum(dt, THRESHOLD))))  # softplus
        dt = tl.where(t_ok, tl.minimum(tl.maximum(dt, dt_min), dt_max), 0.0)
        cum = tl.associative_scan(dt * a, 0, tl.standard._sum_combine)  # a_i
        total = tl.reduce(dt * a, 0, tl.standard._sum_combine)
        x = tl.load(
            x_ptr + t[:, None] * stride_x_t + h * stride_x_h + p[None, :] * stride_x_p,
            mask=t_ok[:, None] & p_ok[None, :],
            other=0.0,
        ).to(tl.float32)
        tn_mask = t_ok[:, None] & n_ok[None, :]
        B = tl.load(
            B_ptr + t[:, None] * stride_B_t + group * stride_B_g + n[None, :] * stride_B_n,
            mask=tn_mask,
            other=0.0,
        ).to(tl.float32)
        C = tl.load(
            C_ptr + t[:, None] * stride_C_t + group * stride_C_g + n[None, :] * stride_C_n,
            mask=tn_mask,
            other=0.0,
        ).to(tl.float32)
        decay = tl.where(causal, tl.exp(tl.where(causal, cum[:, None] - cum[None, :], 0.0)), 0.0)
        x_dt = x * dt[:, None]
        scores = tl.dot(C, tl.trans(B), input_precision="ieee") * decay
        y = tl.dot(scores, x_dt, input_precision="ieee")
        y += tl.dot(C * tl.exp(cum)[:, None], tl.trans(s), input_precision="ieee")
        y += skip * x
        tl.store(
            y_ptr + (t[:, None] * heads + h) * P + p[None, :],
            y.to(y_ptr.dtype.element_ty),
            mask=t_ok[:, None] & p_ok[None, :],
        )
        x_to_end = x_dt * tl.exp(total - cum)[:, None]
        s = s * tl.exp(total) + tl.dot(tl.trans(x_to_end), B, input_precision="ieee")
    tl.store(final_ptr + h * P * N + p[:, None] * N + n[None, :], s, mask=s_mask)
