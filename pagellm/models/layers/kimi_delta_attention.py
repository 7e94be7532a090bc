"""Kimi delta attention (KDA, Kimi Linear's linear-attention layer): the gated delta rule with a decay per key
channel (kda_ops.py), a recurrent state per sequence kept in the state cache as Gated DeltaNet's is.

Per token: q, k and v (one width each, `linear_num_heads` x `linear_head_dim`) pass through a causal
depthwise conv (kernel K, SiLU); the decay of each key channel is -exp(A_log[head]) * softplus(f_b(f_a(x)) +
dt_bias), a low-rank projection; the write strength beta = sigmoid(b(x)) per head; the output goes through
an RMSNorm gated by sigmoid(g_b(g_a(x))), another low-rank projection, and o_proj. A sequence's state is its
conv window (the last K - 1 conv inputs) and S [H, Dk, Dv] float32.

The step's conv and delta rule run in one opaque op, `pagellm::kimi_delta_attention`, as Gated DeltaNet's
`pagellm::gated_delta_net` does: the conv on the platform's kernels (`RecurrentKernels`), the rule in
PyTorch."""

from __future__ import annotations

import torch
from torch import nn

from pagellm.core.state import RecurrentKernels, StateSpec
from pagellm.models.context import ModelInit
from pagellm.models.layers.gated_delta_net import GatedRMSNorm, conv_and_delta_rule
from pagellm.models.layers.kda_ops import kda_decode, kda_prefill
from pagellm.models.layers.linear import Linear
from pagellm.models.layers.recurrent import RecurrentLayer

SOFTPLUS_THRESHOLD = 20.0
"""softplus(x) = x above it, as transformers' KimiLinearForgetGate computes it."""


class SigmoidGatedRMSNorm(GatedRMSNorm):
    """Gated DeltaNet's gated norm with the weight applied in float32 and sigmoid(gate) for silu(z), cast
    back (transformers' KimiLinearRMSNormGated)."""

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = self.weight.float() * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps))
        return (h * torch.sigmoid(gate.float())).to(x.dtype)


class KimiDeltaAttention(RecurrentLayer):
    """One KDA layer. Checkpoint names of transformers' KimiLinearDeltaAttention (the forget gate's
    f_a_proj, f_b_proj, dt_bias and A_log on the layer itself, as the checkpoint keeps them; q, k, v loaded
    into one fused `in_proj_qkv`, `STACKED`; o_proj as `out_proj`)."""

    replays_drafts = True

    STACKED = (
        ("linear_attn.in_proj_qkv", "linear_attn.q_proj", 0),
        ("linear_attn.in_proj_qkv", "linear_attn.k_proj", 1),
        ("linear_attn.in_proj_qkv", "linear_attn.v_proj", 2),
    )

    def __init__(self, init: ModelInit, state_idx: int):
        super().__init__(state_idx)
        c, dtype = init.hf_config, init.dtype
        self.num_heads, self.head_dim = c.linear_num_heads, c.linear_head_dim
        self.width = self.num_heads * self.head_dim
        self.kernel_size = c.linear_conv_kernel_dim
        self.dtype = dtype
        self.in_proj_qkv = Linear(c.hidden_size, 3 * self.width, False, dtype, None, [self.width] * 3)
        # nn.Conv1d's depthwise weight [3 x width, 1, K], as the checkpoint keeps it (joined)
        self.conv1d = nn.Module()
        self.conv1d.weight = _parameter(torch.empty(3 * self.width, 1, self.kernel_size, dtype=dtype))
        self.f_a_proj = Linear(c.hidden_size, self.head_dim, False, dtype)
        self.f_b_proj = Linear(self.head_dim, self.width, False, dtype)
        self.dt_bias = _parameter(torch.empty(self.width, dtype=dtype))
        self.A_log = _parameter(torch.empty(1, 1, self.num_heads, 1, dtype=dtype))
        self.b_proj = Linear(c.hidden_size, self.num_heads, False, dtype)
        self.g_a_proj = Linear(c.hidden_size, self.head_dim, False, dtype)
        self.g_b_proj = Linear(self.head_dim, self.width, False, dtype)
        self.o_norm = SigmoidGatedRMSNorm(self.head_dim, c.rms_norm_eps, dtype)
        self.out_proj = Linear(self.width, c.hidden_size, False, dtype)

    def state_spec(self) -> StateSpec:
        """The conv window in the model's dtype; the delta-rule state in float32, as it is computed."""
        return StateSpec(
            ((3 * self.width, self.kernel_size - 1), (self.num_heads, self.head_dim, self.head_dim)),
            (self.dtype, torch.float32),
        )

    def recurrent_flops_per_token(self) -> float:
        """Per head and state element: the decay (1), k^T S (2), the rank-one update (2), q^T S (2)."""
        return 7.0 * self.num_heads * self.head_dim * self.head_dim

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        tokens = h.shape[0]
        heads = (tokens, self.num_heads, self.head_dim)
        gate = self.f_b_proj(self.f_a_proj(h)).float() + self.dt_bias.float()
        softplus = torch.where(gate > SOFTPLUS_THRESHOLD, gate, torch.log(1.0 + torch.exp(gate)))
        g = -self.A_log.float().view(self.num_heads, 1).exp() * softplus.view(heads)  # log decay per channel
        beta = torch.sigmoid(self.b_proj(h)).float()
        out = torch.ops.pagellm.kimi_delta_attention(
            self.in_proj_qkv(h),
            g,
            beta,
            self.conv1d.weight.view(-1, self.kernel_size),
            self.state_idx,
            self.num_heads,
            self.head_dim,
        )
        out = self.o_norm(out, self.g_b_proj(self.g_a_proj(h)).view(heads))
        return self.out_proj(out.reshape(tokens, self.width))


def _parameter(data: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(data, requires_grad=False)


@torch.library.custom_op("pagellm::kimi_delta_attention", mutates_args=())
def _kimi_delta_attention(
    mixed: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    conv_weight: torch.Tensor,
    state_idx: int,
    num_heads: int,
    head_dim: int,
) -> torch.Tensor:
    """The step's conv and delta rule of recurrent layer `state_idx`: mixed [T, 3 x H x D] (q, k, v before
    the conv), g [T, H, D] and beta [T, H] float32 -> o [T, H, D]; reads and writes the requests' states in
    the forward context (none in a memory-profiling step: one sequence from zero states, nothing kept)."""

    def split_heads(x: torch.Tensor) -> list[torch.Tensor]:
        return list(x.unflatten(-1, (3, num_heads, head_dim)).unbind(-3))

    def prefill(kernels: RecurrentKernels | None, *args: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return kda_prefill(*args)

    def decode(kernels: RecurrentKernels, *args: torch.Tensor) -> torch.Tensor:
        *inputs, states, slots = args
        batch = states.index_select(0, slots)
        out = kda_decode(*inputs, batch)
        states.index_copy_(0, slots, batch)
        return out

    return conv_and_delta_rule(
        mixed, conv_weight, state_idx, split_heads, g, beta, (num_heads, head_dim), prefill, decode
    )


@_kimi_delta_attention.register_fake
def _(mixed, g, beta, conv_weight, state_idx, num_heads, head_dim):
    return mixed.new_empty(mixed.shape[0], num_heads, head_dim)
