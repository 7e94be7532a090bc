"""Plain-torch ops of Gated DeltaNet layers (Qwen3-Next, Qwen3.5): the causal depthwise conv1d with its carried
inputs, and the gated delta rule in its chunked form (prefill) and its recurrent form (decode).

These are the references the fast paths are checked against, and the path every platform can run. The engine
keeps two states per sequence and layer: the conv state, the last K-1 inputs of the conv ([D, K-1]), and the
recurrent state S ([H, Dk, Dv], float32). Prefill ops work on one sequence and return the new state, so that a
prefill chunk can continue from where the previous one stopped; decode ops take B sequences at once and update
their states in place, so the state cache can hand in views of its slots.

Math is done in float32 whatever the input dtype (as transformers' and fla's references do): the recurrent state
is a running sum over the whole sequence and bfloat16 rounding would build up in it."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagellm.models.layers.activation import get_activation

L2NORM_EPS = 1e-6


def causal_conv1d_prefill(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    state: torch.Tensor,
    activation: str | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal depthwise conv over one sequence's new tokens, continuing from the inputs before them.

    x [T, D] the new tokens (T >= 1); weight [D, K] (nn.Conv1d's depthwise weight squeezed); bias [D] or None;
    state [D, K-1] the K-1 inputs before x (zeros for a fresh sequence, which is what a zero-padded conv sees);
    activation "silu" or None. Returns (y [T, D] in x's dtype, new_state [D, K-1] in state's dtype). `state` is
    read, not written: it may be a view into the state cache, and the caller decides where the new one goes.

    new_state is the last K-1 columns of (state ++ x), not of x alone, so a chunk shorter than K-1 tokens still
    hands the next chunk the right inputs."""
    length, width = x.shape[0], weight.shape[1] - 1
    weight = weight.float()
    inputs = torch.cat([state.t().float(), x.float()])  # [K-1 + T, D]
    # One multiply-add per tap over [T, D]: several times faster on CPU than F.conv1d's depthwise path.
    y = inputs[:length] * weight[:, 0]
    for tap in range(1, width + 1):
        y.addcmul_(inputs[tap : tap + length], weight[:, tap])
    if bias is not None:
        y += bias.float()
    if activation is not None:
        y = get_activation(activation)(y)
    new_state = inputs[length:].t().to(state.dtype).contiguous()
    return y.to(x.dtype), new_state


def causal_conv1d_decode(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    state: torch.Tensor,
    activation: str | None,
) -> torch.Tensor:
    """One new token for each of B sequences: x [B, D], state [B, D, K-1]. Returns y [B, D] in x's dtype.

    `state` is updated in place (shifted left by one, x appended), because in decode it is the state cache's own
    memory and a step should not copy every sequence's state out and back."""
    weight = weight.float()
    y = x.float() * weight[:, -1]
    for tap in range(weight.shape[1] - 1):
        y.addcmul_(state[..., tap].float(), weight[:, tap])
    if bias is not None:
        y += bias.float()
    if activation is not None:
        y = get_activation(activation)(y)
    state.copy_(torch.cat([state[..., 1:], x.unsqueeze(-1).to(state.dtype)], dim=-1))
    return y.to(x.dtype)


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over one sequence's prefill (or prefill chunk), a chunk of tokens at a time.

    q, k [T, H, Dk] (T >= 1); v [T, H, Dv] (heads already repeated to the value heads); g [T, H] log decay (<= 0);
    beta [T, H] in (0, 1); state [H, Dk, Dv] float32, the state before these tokens (zeros for a fresh sequence);
    it is read, not written. q and k are L2-normalised and q scaled by Dk**-0.5 here, as in transformers with
    use_qk_l2norm_in_kernel=True. Returns (o [T, H, Dv] in v's dtype, final_state [H, Dk, Dv] float32).

    The rule, per head and token t, with S a [Dk, Dv] map from keys to values:
        S' = exp(g_t) S;  d_t = beta_t (v_t - S'^T k_t);  S = S' + k_t d_t^T;  o_t = S^T q_t.
    Token by token that is T dependent steps of rank-one updates. Within a chunk of C tokens starting from S0,
    with G_i the cumulative log decay up to position i, each correction d_i depends on S0 and on the earlier d_j:
        d_i + beta_i sum_{j<i} exp(G_i - G_j) (k_i . k_j) d_j = beta_i v_i - beta_i exp(G_i) S0^T k_i,
    a unit lower-triangular system (I + A) d = U - W S0 whose U and W do not depend on S0. So every chunk's
    triangular inverse and its in-chunk q.k products are batched over all chunks at once, and only the short scan
    from chunk to chunk (two [C, Dk] x [Dk, Dv] products per head) is sequential:
        o_i = exp(G_i) S0^T q_i + sum_{j<=i} exp(G_i - G_j) (q_i . k_j) d_j,
        S_C = exp(G_C) S0 + sum_j exp(G_C - G_j) k_j d_j^T.
    Only differences G_i - G_j with j <= i are exponentiated, so every factor is <= 1 and nothing overflows."""
    length, heads, _ = k.shape
    out_dtype = v.dtype
    chunk = min(chunk_size, length)
    chunks = -(-length // chunk)
    pad = chunks * chunk - length

    def per_chunk(t: torch.Tensor) -> torch.Tensor:
        """[T, H, ...] -> float32 [H, chunks, chunk, ...], zero padded at the end. A padded token has k = 0 and
        beta = 0, so it writes nothing, and g = 0, so it does not decay the state: the final state is unchanged."""
        t = t.float().transpose(0, 1)
        t = F.pad(t, (0, 0, 0, pad)) if t.dim() == 3 else F.pad(t, (0, pad))
        return t.reshape(heads, chunks, chunk, *t.shape[2:])

    q = _l2norm(q.float()) * q.shape[-1] ** -0.5
    k = _l2norm(k.float())
    q, k, v, g, beta = (per_chunk(t) for t in (q, k, v, g, beta))

    cum = g.cumsum(-1)  # [H, n, C]: G_i
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    # exp(G_i - G_j) for j <= i, 0 above the diagonal
    decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(~causal, float("-inf")).exp()

    k_beta = k * beta.unsqueeze(-1)
    system = (k_beta @ k.transpose(-1, -2)) * decay  # its strict lower triangle is A
    inverse = _unit_lower_inverse(system)
    u = inverse @ (v * beta.unsqueeze(-1))
    w = inverse @ (k_beta * cum.exp().unsqueeze(-1))

    attn = (q @ k.transpose(-1, -2)) * decay  # [H, n, C, C]
    q_decayed = q * cum.exp().unsqueeze(-1)  # reads S0 decayed to position i
    k_to_end = (k * (cum[..., -1:] - cum).exp().unsqueeze(-1)).transpose(-1, -2)  # [H, n, Dk, C]
    chunk_decay = cum[..., -1].exp()[..., None, None]  # [H, n, 1, 1]

    s = state.float()
    out = torch.empty_like(u)
    for i in range(chunks):
        d = u[:, i] - w[:, i] @ s
        out[:, i] = q_decayed[:, i] @ s + attn[:, i] @ d
        s = s * chunk_decay[:, i] + k_to_end[:, i] @ d

    out = out.reshape(heads, chunks * chunk, -1)[:, :length].transpose(0, 1)
    return out.to(out_dtype).contiguous(), s


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> torch.Tensor:
    """One decode step of the gated delta rule for each of B sequences (the rule is in `chunk_gated_delta_rule`).

    q, k [B, H, Dk]; v [B, H, Dv]; g, beta [B, H]; state [B, H, Dk, Dv] float32, updated in place (it is the
    state cache's memory; any strides). Returns o [B, H, Dv] in v's dtype. Same normalisation and scale of q
    and k as the chunked form."""
    per_channel = g.unsqueeze(-1).expand(*g.shape, k.shape[-1])  # every key channel decays alike
    return recurrent_channel_gated_delta_rule(q, k, v, per_channel, beta, state)


def recurrent_channel_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> torch.Tensor:
    """The decode step with a log decay per key channel, g [B, H, Dk] (Kimi delta attention's; Gated
    DeltaNet's per-head decay is the case where the channels decay alike). Otherwise as
    `recurrent_gated_delta_rule`: state [B, H, Dk, Dv] float32 updated in place; o [B, H, Dv] in v's dtype."""
    if state.dtype != torch.float32:
        raise ValueError(f"the recurrent state must be float32, got {state.dtype}")
    return delta_rule_step(*prepare_delta_inputs(q, k, v, g, beta), state).to(v.dtype)


def prepare_delta_inputs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """Float32, q and k L2-normalised, q scaled by Dk**-0.5: what `delta_rule_step` takes."""
    q = _l2norm(q.float()) * q.shape[-1] ** -0.5
    return q, _l2norm(k.float()), v.float(), g.float(), beta.float()


def delta_rule_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, s: torch.Tensor
) -> torch.Tensor:
    """One token of N sequences (prepared, g [N, H, Dk] per key channel): S' = diag(exp(g)) S,
    S = S' + k (beta (v - S'^T k))^T, o = S^T q; s [N, H, Dk, Dv] updated in place, o [N, H, Dv] float32."""
    s.mul_(g.exp().unsqueeze(-1))
    predicted = (k.unsqueeze(-2) @ s).squeeze(-2)  # S'^T k: [N, H, Dv]
    delta = (v - predicted) * beta.unsqueeze(-1)
    s.addcmul_(k.unsqueeze(-1), delta.unsqueeze(-2))
    return (q.unsqueeze(-2) @ s).squeeze(-2)


def _unit_lower_inverse(a: torch.Tensor, block: int = 16) -> torch.Tensor:
    """(I + A)^-1 for the strict lower triangle A of a [..., C, C] (what is on and above the diagonal is ignored).

    Forward substitution a block of rows at a time: the diagonal blocks are inverted all together
    (`_unit_lower_inverse_rows`), then block row i of the inverse is X_ii (E_i - sum_{j<i} A_ij X_j), a few
    batched matmuls. This replaces torch.linalg.solve_triangular, which solves a batch one matrix at a time and,
    on a 2-core CPU, took a second for 128 chunks of 64 where this takes about a tenth of that; the two agree
    to float32 rounding."""
    size = a.shape[-1]
    if size <= block:
        return _unit_lower_inverse_rows(a)
    blocks = -(-size // block)
    pad = blocks * block - size
    a = F.pad(a, (0, pad, 0, pad))  # zero rows and columns: the padded inverse is the inverse padded with I
    tiles = a.unflatten(-2, (blocks, block)).unflatten(-1, (blocks, block))
    diagonal = _unit_lower_inverse_rows(
        tiles.diagonal(dim1=-4, dim2=-2).movedim(-1, -3)
    )  # [..., blocks, b, b]
    inverse = torch.zeros_like(a)
    for i in range(blocks):
        rows, done = slice(i * block, (i + 1) * block), i * block
        inverse[..., rows, rows] = diagonal[..., i, :, :]
        if i:
            below = a[..., rows, :done] @ inverse[..., :done, :done]
            inverse[..., rows, :done] = -(diagonal[..., i, :, :] @ below)
    return inverse[..., :size, :size]


def _unit_lower_inverse_rows(a: torch.Tensor) -> torch.Tensor:
    """(I + A)^-1 for the strict lower triangle A of a [..., C, C], a row at a time: row i of the inverse is
    e_i - sum_{j<i} A_ij (row j), C - 1 batched vector-matrix products."""
    size = a.shape[-1]
    inverse = torch.eye(size, dtype=a.dtype, device=a.device).expand(a.shape).clone()
    for i in range(1, size):
        inverse[..., i, :i] = -(a[..., i : i + 1, :i] @ inverse[..., :i, :i]).squeeze(-2)
    return inverse


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(|x|^2 + eps) over the last dim: eps inside the root, as transformers and fla compute it."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)
