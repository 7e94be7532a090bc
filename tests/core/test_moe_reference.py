"""The plain fused-MoE reference against a per-token loop: the oracle kernels are checked against must
itself be right (grouping by expert, skipped experts, weights, biases, each activation)."""

import pytest
import torch

from pagellm.core.moe import ACTIVATIONS, activate, fused_experts_reference


def per_token(hidden, w13, w2, topk_weights, topk_ids, activation, w13_bias, w2_bias):
    out = torch.zeros(hidden.shape[0], w2.shape[1], dtype=torch.float64)
    for t in range(hidden.shape[0]):
        for k in range(topk_ids.shape[1]):
            e = int(topk_ids[t, k])
            gate_up = hidden[t].double() @ w13[e].double().T
            if w13_bias is not None:
                gate_up = gate_up + w13_bias[e].double()
            y = activate(gate_up[None], activation).double()[0] @ w2[e].double().T
            if w2_bias is not None:
                y = y + w2_bias[e].double()
            out[t] += float(topk_weights[t, k]) * y
    return out


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(
    "routing", ["random", "one_token", "all_to_one", "top_k_is_e", "empty_experts", "no_tokens"]
)
def test_reference_matches_a_per_token_loop(activation, bias, routing):
    g = torch.Generator().manual_seed(0)
    num_experts, hidden_size, inter = 6, 16, 8
    tokens, top_k = {"one_token": (1, 2), "no_tokens": (0, 2), "top_k_is_e": (5, num_experts)}.get(
        routing, (9, 2)
    )
    hidden = torch.randn(tokens, hidden_size, generator=g)
    w13 = torch.randn(num_experts, 2 * inter, hidden_size, generator=g) / 4
    w2 = torch.randn(num_experts, hidden_size, inter, generator=g) / 3
    w13_bias = torch.randn(num_experts, 2 * inter, generator=g) if bias else None
    w2_bias = torch.randn(num_experts, hidden_size, generator=g) if bias else None
    if routing == "no_tokens":
        ids = torch.zeros(0, top_k, dtype=torch.int64)
    elif routing == "all_to_one":
        ids = torch.tensor([[3, 1]] * tokens)
    elif routing == "top_k_is_e":
        ids = torch.stack([torch.randperm(num_experts, generator=g) for _ in range(tokens)])
    elif routing == "empty_experts":
        ids = torch.stack([torch.randperm(2, generator=g) * 4 for _ in range(tokens)])  # experts 0 and 4 only
    else:
        ids = torch.stack([torch.randperm(num_experts, generator=g)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=g)
    got = fused_experts_reference(
        hidden, w13, w2, weights, ids, activation=activation, w13_bias=w13_bias, w2_bias=w2_bias
    )
    want = per_token(hidden, w13, w2, weights, ids, activation, w13_bias, w2_bias)
    assert got.shape == (tokens, hidden_size) and got.dtype == hidden.dtype
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)


def test_unknown_activation_is_named():
    with pytest.raises(ValueError, match="gelu_new"):
        activate(torch.zeros(1, 4), "gelu_new")
