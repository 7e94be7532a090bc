"""Gated DeltaNet (Qwen3-Next, Qwen3.5): linear attention with a delta-rule state per sequence, the layer
three of every four Qwen3-Next layers are.

Per token: one projection gives q, k, v and the output gate z (grouped per key head in the checkpoint),
another the decay input a and the write strength b; q, k and v pass through a causal depthwise conv (kernel
K, SiLU) over the sequence; then the delta rule S <- exp(g) S + beta k (v - k^T exp(g) S)... reads q out of
the state S [Dk, Dv] per value head (recurrent_ops.py has the forms), and a gated RMSNorm (norm(o) * silu(z))
and the output projection finish it. A sequence's state is its conv window (the last K - 1 conv inputs)
and S per head, kept in its slot between steps (core/state.py).

The step's conv and delta rule run in one opaque op, `pagellm::gated_delta_net`, which reads the states
from the forward context and writes them back, as `pagellm::attention` does the KV cache: torch.compile
sees the projections and norms, not the per-sequence loop."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.core.state import RecurrentKernels, StateSpec
from pagellm.models.context import DraftReplay, ModelInit, get_forward_context
from pagellm.models.layers.linear import Linear
from pagellm.models.layers.recurrent import RecurrentLayer
from pagellm.models.layers.recurrent_kernels import complete
from pagellm.models.layers.recurrent_ops import (
    causal_conv1d_prefill,
    chunk_gated_delta_rule,
)


class GatedRMSNorm(nn.Module):
    """RMSNorm of each head's output (weight w, not 1 + w), times silu(z), in float32."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight * h.to(x.dtype)
        return (h * F.silu(gate.float())).to(x.dtype)


class GatedDeltaNet(RecurrentLayer):
    """One Gated DeltaNet layer (checkpoint names of transformers' Qwen3NextGatedDeltaNet: in_proj_qkvz,
    in_proj_ba, conv1d, dt_bias, A_log, norm, out_proj).

    `grouped`: Qwen3-Next's projections, whose outputs come grouped per key head (q, k, then v and z of its
    value heads; b then a likewise). Else Qwen3.5's, separate in the checkpoint (in_proj_qkv, in_proj_z,
    in_proj_b, in_proj_a) and in plain order, loaded into the same two fused linears (`STACKED`)."""

    replays_drafts = True

    STACKED = (
        ("in_proj_qkvz", "in_proj_qkv", 0),
        ("in_proj_qkvz", "in_proj_z", 1),
        ("in_proj_ba", "in_proj_b", 0),
        ("in_proj_ba", "in_proj_a", 1),
    )
    """Qwen3.5's checkpoint names, as fused parts of the layer's linears (for `copy_weights`)."""

    def __init__(
        self,
        init: ModelInit,
        state_idx: int,
        grouped: bool = True,
        beta_scale: float = 1.0,
        norm_eps: float | None = None,
    ):
        """`beta_scale`: the write strength is sigmoid(b) times this (2: OLMo Hybrid's negative eigenvalues,
        beta in (0, 2)); `norm_eps`: the output norm's epsilon, where it is not the config's `rms_norm_eps`."""
        super().__init__(state_idx)
        self.grouped = grouped
        self.beta_scale = beta_scale
        c = init.hf_config
        self.num_k_heads, self.num_v_heads = c.linear_num_key_heads, c.linear_num_value_heads
        self.head_k_dim, self.head_v_dim = c.linear_key_head_dim, c.linear_value_head_dim
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.kernel_size = c.linear_conv_kernel_dim
        self.dtype = init.dtype
        qkv_z = [self.conv_dim, self.value_dim] if not grouped else None
        b_a = [self.num_v_heads, self.num_v_heads] if not grouped else None
        self.in_proj_qkvz = Linear(
            c.hidden_size, self.conv_dim + self.value_dim, False, init.dtype, None, qkv_z
        )
        self.in_proj_ba = Linear(c.hidden_size, 2 * self.num_v_heads, False, init.dtype, None, b_a)
        # nn.Conv1d's depthwise weight [conv_dim, 1, K], as the checkpoint keeps it
        self.conv1d = nn.Module()
        self.conv1d.weight = nn.Parameter(
            torch.empty(self.conv_dim, 1, self.kernel_size, dtype=init.dtype), requires_grad=False
        )
        self.dt_bias = nn.Parameter(torch.empty(self.num_v_heads, dtype=init.dtype), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads, dtype=init.dtype), requires_grad=False)
        self.norm = GatedRMSNorm(self.head_v_dim, norm_eps or c.rms_norm_eps, init.dtype)
        self.out_proj = Linear(self.value_dim, c.hidden_size, False, init.dtype)

    def recurrent_flops_per_token(self) -> float:
        """Per value head and state element: the decay (1), k^T S (2), the rank-one update (2), q^T S (2)."""
        return 7.0 * self.num_v_heads * self.head_k_dim * self.head_v_dim

    def _project(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q, k, v side by side [T, conv_dim], z, b, a) in plain head order."""
        tokens = h.shape[0]
        qkvz, ba = self.in_proj_qkvz(h), self.in_proj_ba(h)
        if not self.grouped:
            mixed, z = qkvz.split([self.conv_dim, self.value_dim], dim=-1)
            b, a = ba.split([self.num_v_heads, self.num_v_heads], dim=-1)
            return mixed, z, b, a
        per_k = self.num_v_heads // self.num_k_heads  # value heads per key head
        # grouped per key head: [q, k, v of its value heads, z of them]; [b of them, a of them]
        q, k, v, z = qkvz.view(tokens, self.num_k_heads, -1).split(
            [self.head_k_dim, self.head_k_dim, per_k * self.head_v_dim, per_k * self.head_v_dim], dim=-1
        )
        b, a = ba.view(tokens, self.num_k_heads, 2 * per_k).split([per_k, per_k], dim=-1)
        mixed = torch.cat([q.reshape(tokens, -1), k.reshape(tokens, -1), v.reshape(tokens, -1)], dim=-1)
        return mixed, z.reshape(tokens, -1), b.reshape(tokens, -1), a.reshape(tokens, -1)

    def state_spec(self) -> StateSpec:
        """The conv window in the model's dtype; the delta-rule state in float32, as it is computed."""
        return StateSpec(
            ((self.conv_dim, self.kernel_size - 1), (self.num_v_heads, self.head_k_dim, self.head_v_dim)),
            (self.dtype, torch.float32),
        )

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        tokens = h.shape[0]
        mixed, z, b, a = self._project(h)
        out = torch.ops.pagellm.gated_delta_net(
            mixed,
            a.reshape(tokens, self.num_v_heads),
            b.reshape(tokens, self.num_v_heads),
            self.conv1d.weight.view(self.conv_dim, self.kernel_size),
            self.A_log,
            self.dt_bias,
            self.state_idx,
            self.num_k_heads,
            self.head_k_dim,
            self.head_v_dim,
            self.beta_scale,
        )
        out = self.norm(out, z.reshape(tokens, self.num_v_heads, self.head_v_dim))
        return self.out_proj(out.reshape(tokens, self.value_dim))


@torch.library.custom_op("pagellm::gated_delta_net", mutates_args=())
def _gated_delta_net(
    mixed: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    conv_weight: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state_idx: int,
    num_k_heads: int,
    head_k_dim: int,
    head_v_dim: int,
    beta_scale: float = 1.0,
) -> torch.Tensor:
    """The step's conv and delta rule of recurrent layer `state_idx`: mixed [T, conv_dim] (q, k, v before
    the conv), a and b [T, Hv] -> o [T, Hv, Dv], the write strength sigmoid(b) * beta_scale; reads and
    writes the requests' states in the forward context (none in a memory-profiling step: one sequence from
    zero states, nothing kept)."""
    num_v_heads = a.shape[1]
    key_dim = num_k_heads * head_k_dim
    beta = b.float().sigmoid() * beta_scale
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())  # log decay, <= 0

    def split_heads(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = x.split([key_dim, key_dim, x.shape[-1] - 2 * key_dim], dim=-1)
        q = q.unflatten(-1, (num_k_heads, head_k_dim)).repeat_interleave(num_v_heads // num_k_heads, dim=-2)
        k = k.unflatten(-1, (num_k_heads, head_k_dim)).repeat_interleave(num_v_heads // num_k_heads, dim=-2)
        return q, k, v.unflatten(-1, (num_v_heads, head_v_dim))

    def prefill(kernels: RecurrentKernels | None, *args: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (kernels.chunk_gated_delta_rule if kernels else chunk_gated_delta_rule)(*args)

    def decode(kernels: RecurrentKernels, *args: torch.Tensor) -> torch.Tensor:
        return kernels.gated_delta_rule_update(*args)

    return conv_and_delta_rule(
        mixed, conv_weight, state_idx, split_heads, g, beta, (num_v_heads, head_v_dim), prefill, decode
    )


def conv_and_delta_rule(
    mixed: torch.Tensor,
    conv_weight: torch.Tensor,
    state_idx: int,
    split_heads: Callable[[torch.Tensor], Sequence[torch.Tensor]],
    g: torch.Tensor,
    beta: torch.Tensor,
    out_heads: tuple[int, int],
    prefill: Callable[..., tuple[torch.Tensor, torch.Tensor]],
    decode: Callable[..., torch.Tensor],
) -> torch.Tensor:
    """What a delta-rule layer's op does with the step's requests (Gated DeltaNet's, Kimi delta
    attention's): the SiLU conv over mixed [T, conv_dim], split_heads(conv output) -> (q, k, v), then the
    rule -> o [T, *out_heads]. `prefill(kernels, q, k, v, g, beta, state)` -> (o, new state) runs one
    sequence (kernels None in a memory-profiling step, which has no states: one sequence from zeros,
    nothing kept); `decode(kernels, q, k, v, g, beta, states, slots)` -> o advances every request one token
    at once, updating `states` at `slots`. A request's fresh states are zeroed before its first chunk."""
    state = get_forward_context().state
    if state is None:  # memory profiling: one sequence from nothing
        conv_state = mixed.new_zeros(mixed.shape[1], conv_weight.shape[1] - 1)
        x, _ = causal_conv1d_prefill(mixed, conv_weight, None, conv_state, "silu")
        q, k, v = split_heads(x)
        zeros = torch.zeros(q.shape[1], q.shape[2], v.shape[2], dtype=torch.float32, device=mixed.device)
        return prefill(None, q, k, v, g, beta, zeros)[0]
    kernels = complete(state.kernels)
    conv_states, delta_states = state.caches[state_idx]
    if state.decode_only:  # one token per request: every request's update at once
        x = kernels.conv1d_update(mixed, conv_weight, None, conv_states, state.slots, "silu")
        return decode(kernels, *split_heads(x), g, beta, delta_states, state.slots)
    out = mixed.new_empty(mixed.shape[0], *out_heads)
    qsl = state.query_start_loc

    def advance(slot: int, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
        x, conv_states[slot] = kernels.causal_conv1d_prefill(
            mixed, conv_weight, None, conv_states[slot], "silu"
        )
        o, delta_states[slot] = prefill(kernels, *split_heads(x), g, beta, delta_states[slot])
        return o

    for i, slot in enumerate(state.slot_list):
        rows = slice(qsl[i], qsl[i + 1])
        if state.fresh[i]:
            conv_states[slot].zero_()
            delta_states[slot].zero_()
        if state.drafts is not None and state.drafts[i]:
            state.replays.append(
                DraftReplay(i, rows.stop - rows.start, _replay(advance, slot, conv_states, delta_states,
                                                               mixed[rows], g[rows], beta[rows]))
            )  # fmt: skip
        out[rows] = advance(slot, mixed[rows], g[rows], beta[rows])
    return out


def _replay(advance: Callable[..., torch.Tensor], slot: int, conv_states: torch.Tensor,
            delta_states: torch.Tensor, *inputs: torch.Tensor) -> Callable[[int], None]:  # fmt: skip
    """How to put back a slot's states as they are now and advance them over the first n of the rows
    `inputs` (copied: a compiled graph may reuse the step's buffers)."""
    conv, delta, kept = conv_states[slot].clone(), delta_states[slot].clone(), [x.clone() for x in inputs]

    def replay(n: int) -> None:
        conv_states[slot].copy_(conv)
        delta_states[slot].copy_(delta)
        advance(slot, *(x[:n] for x in kept))

    return replay


@_gated_delta_net.register_fake
def _(
    mixed, a, b, conv_weight, A_log, dt_bias, state_idx, num_k_heads, head_k_dim, head_v_dim, beta_scale=1.0
):
    return mixed.new_empty(a.shape[0], a.shape[1], head_v_dim)
