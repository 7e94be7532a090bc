"""The Gated DeltaNet ops in `pagellm.models.layers.recurrent_ops` against transformers' own torch references
(`causal_conv1d_fn` / `causal_conv1d_update`, `torch_chunk_gated_delta_rule` / `torch_recurrent_gated_delta_rule`
of Qwen3-Next), and against themselves: a prefill cut into chunks that carry the returned state, decode steps
after a prefill, and B sequences decoded together, each give what one pass over the whole sequence gives."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_next.modeling_qwen3_next import (
    causal_conv1d_fn,
    causal_conv1d_update,
    torch_chunk_gated_delta_rule,
    torch_recurrent_gated_delta_rule,
)

from pagellm.models.layers.recurrent_ops import (
    causal_conv1d_decode,
    causal_conv1d_prefill,
    chunk_gated_delta_rule,
    recurrent_gated_delta_rule,
)

D, K = 24, 4  # conv channels and kernel width
H, DK, DV = 3, 8, 16  # heads, key and value head dims
TOL = {"atol": 1e-5, "rtol": 1e-5}
BF16_TOL = {"atol": 2e-2, "rtol": 2e-2}


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _conv_weights(gen, bias: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    return torch.randn(D, K, generator=gen), torch.randn(D, generator=gen) if bias else None


def _hf_conv(x: torch.Tensor, weight, bias, activation) -> torch.Tensor:
    """transformers' prefill conv of one whole sequence: x [T, D] -> [T, D]."""
    return causal_conv1d_fn(x.t().unsqueeze(0), weight, bias, activation=activation).squeeze(0).t()


def _rule_inputs(gen, length: int, batch: int | None = None):
    """q, k, v, g, beta shaped [T, H, ...] (or [batch, H, ...] for decode when batch is given), with decays and
    betas in the ranges the model produces (g = -A softplus(a + dt_bias), beta = sigmoid(b))."""
    lead = (length,) if batch is None else (batch,)
    q = torch.randn(*lead, H, DK, generator=gen)
    k = torch.randn(*lead, H, DK, generator=gen)
    v = torch.randn(*lead, H, DV, generator=gen)
    g = -torch.rand(*lead, H, generator=gen) * 2 * F.softplus(torch.randn(*lead, H, generator=gen))
    beta = torch.sigmoid(torch.randn(*lead, H, generator=gen))
    return q, k, v, g, beta


def _hf_chunk(q, k, v, g, beta, state):
    out, final = torch_chunk_gated_delta_rule(
        q[None], k[None], v[None], g[None], beta[None], initial_state=state[None],
        output_final_state=True, use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    return out[0], final[0]


# ---- causal conv1d ----


@pytest.mark.parametrize("length", [1, 2, 3, 5, 64, 65])
@pytest.mark.parametrize("bias,activation", [(True, "silu"), (False, None)])
def test_conv_prefill_of_a_fresh_sequence_matches_transformers(length, bias, activation):
    gen = _gen(length)
    weight, b = _conv_weights(gen, bias)
    x = torch.randn(length, D, generator=gen)
    state = torch.zeros(D, K - 1)
    y, new_state = causal_conv1d_prefill(x, weight, b, state, activation)
    torch.testing.assert_close(y, _hf_conv(x, weight, b, activation), **TOL)
    expected_state = torch.cat([state, x.t()], dim=1)[:, -(K - 1) :]
    assert torch.equal(new_state, expected_state)
    assert torch.equal(state, torch.zeros(D, K - 1)), "the state passed in is read, not written"


def test_conv_prefill_in_chunks_carrying_the_state_equals_one_pass():
    """Chunks of 1 token and chunks shorter than K-1 too: the carried state must reach back into the chunk
    before the previous one."""
    gen = _gen(1)
    weight, bias = _conv_weights(gen)
    sizes = [1, 2, 1, 1, 5, 3, 20, 1, 2]
    x = torch.randn(sum(sizes), D, generator=gen)
    whole, whole_state = causal_conv1d_prefill(x, weight, bias, torch.zeros(D, K - 1), "silu")
    state, pieces = torch.zeros(D, K - 1), []
    for piece in x.split(sizes):
        y, state = causal_conv1d_prefill(piece, weight, bias, state, "silu")
        pieces.append(y)
    torch.testing.assert_close(torch.cat(pieces), whole, **TOL)
    torch.testing.assert_close(state, whole_state, **TOL)
    torch.testing.assert_close(whole, _hf_conv(x, weight, bias, "silu"), **TOL)


def test_conv_decode_after_prefill_matches_transformers_update_and_a_longer_prefill():
    """B sequences of different prefill lengths (one shorter than K-1) decode together with their states in a
    strided view of a bigger cache. transformers' cache keeps the last K inputs where ours keeps K-1: the
    outputs must agree all the same."""
    gen = _gen(2)
    weight, bias = _conv_weights(gen)
    prompts = [torch.randn(n, D, generator=gen) for n in (1, 4, 9)]
    steps = torch.randn(5, len(prompts), D, generator=gen)
    cache = torch.full((2 * len(prompts), D, K - 1), float("nan"))
    state = cache[::2]  # this batch's slots
    for i, prompt in enumerate(prompts):
        _, state[i] = causal_conv1d_prefill(prompt, weight, bias, torch.zeros(D, K - 1), "silu")
    hf_state = torch.stack([F.pad(p.t(), (K, 0))[:, -K:] for p in prompts])  # [B, D, K]
    outputs = []
    for x in steps:
        y = causal_conv1d_decode(x, weight, bias, state, "silu")
        hf_y = causal_conv1d_update(x.unsqueeze(-1), hf_state, weight, bias, "silu").squeeze(-1)
        torch.testing.assert_close(y, hf_y, **TOL)
        outputs.append(y)
    assert cache[1::2].isnan().all(), "the slots between this batch's stay untouched"
    for i, prompt in enumerate(prompts):
        longer = torch.cat([prompt, steps[:, i]])
        y, final = causal_conv1d_prefill(longer, weight, bias, torch.zeros(D, K - 1), "silu")
        torch.testing.assert_close(torch.stack(outputs)[:, i], y[len(prompt) :], **TOL)
        torch.testing.assert_close(state[i], final, **TOL)


def test_conv_bfloat16_inputs_come_close_to_the_float32_reference():
    gen = _gen(3)
    weight, bias = _conv_weights(gen)
    x = torch.randn(7, D, generator=gen).bfloat16()
    state = torch.randn(D, K - 1, generator=gen).bfloat16()
    y, new_state = causal_conv1d_prefill(x, weight, bias, state, "silu")
    ref, _ = causal_conv1d_prefill(x.float(), weight, bias, state.float(), "silu")
    assert y.dtype == torch.bfloat16 and new_state.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), ref, **BF16_TOL)
    step = torch.randn(2, D, generator=gen).bfloat16()
    batch_state = torch.stack([new_state, new_state])
    y = causal_conv1d_decode(step, weight, bias, batch_state, "silu")
    ref = causal_conv1d_decode(
        step.float(), weight, bias, torch.stack([new_state, new_state]).float(), "silu"
    )
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), ref, **BF16_TOL)


# ---- gated delta rule ----


@pytest.mark.parametrize("length", [1, 2, 3, 5, 64, 65, 130])
@pytest.mark.parametrize("fresh", [True, False], ids=["zero-state", "carried-state"])
def test_chunk_rule_matches_transformers(length, fresh):
    gen = _gen(length)
    q, k, v, g, beta = _rule_inputs(gen, length)
    state = torch.zeros(H, DK, DV) if fresh else torch.randn(H, DK, DV, generator=gen)
    before = state.clone()
    out, final = chunk_gated_delta_rule(q, k, v, g, beta, state)
    hf_out, hf_final = _hf_chunk(q, k, v, g, beta, state)
    torch.testing.assert_close(out, hf_out, **TOL)
    torch.testing.assert_close(final, hf_final, **TOL)
    assert torch.equal(state, before), "the state passed in is read, not written"


def test_chunk_rule_in_pieces_carrying_the_state_equals_one_pass():
    gen = _gen(4)
    sizes = [1, 63, 2, 65, 5, 1, 70]
    q, k, v, g, beta = _rule_inputs(gen, sum(sizes))
    state = torch.randn(H, DK, DV, generator=gen)
    whole, whole_final = chunk_gated_delta_rule(q, k, v, g, beta, state)
    carried, pieces = state, []
    for piece in zip(*(t.split(sizes) for t in (q, k, v, g, beta)), strict=True):
        out, carried = chunk_gated_delta_rule(*piece, carried)
        pieces.append(out)
    torch.testing.assert_close(torch.cat(pieces), whole, **TOL)
    torch.testing.assert_close(carried, whole_final, **TOL)
    small_chunks, small_final = chunk_gated_delta_rule(q, k, v, g, beta, state, chunk_size=16)
    torch.testing.assert_close(small_chunks, whole, **TOL)
    torch.testing.assert_close(small_final, whole_final, **TOL)


def test_recurrent_rule_token_by_token_equals_the_chunk_rule_and_transformers():
    gen = _gen(5)
    q, k, v, g, beta = _rule_inputs(gen, 65)
    initial = torch.randn(H, DK, DV, generator=gen)
    chunked, chunked_final = chunk_gated_delta_rule(q, k, v, g, beta, initial)
    state = initial.clone().unsqueeze(0)
    hf_state, outputs = initial.unsqueeze(0), []
    for t in range(q.shape[0]):
        step = [x[t : t + 1] for x in (q, k, v, g, beta)]
        outputs.append(recurrent_gated_delta_rule(*step, state)[0])
        hf_out, hf_state = torch_recurrent_gated_delta_rule(
            *(x.unsqueeze(1) for x in step), initial_state=hf_state, output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )  # fmt: skip
        torch.testing.assert_close(outputs[-1], hf_out[0, 0], **TOL)
        torch.testing.assert_close(state, hf_state, **TOL)
    torch.testing.assert_close(torch.stack(outputs), chunked, **TOL)
    torch.testing.assert_close(state[0], chunked_final, **TOL)


def test_batched_decode_equals_each_sequence_alone_and_updates_its_slots_in_place():
    gen = _gen(6)
    batch = 4
    q, k, v, g, beta = _rule_inputs(gen, 0, batch=batch)
    cache = torch.full((2 * batch, H, DK, DV), float("nan"))
    states = cache[1::2]  # strided slots of a bigger cache
    states.copy_(torch.randn(batch, H, DK, DV, generator=gen))
    alone = []
    for b in range(batch):
        one = states[b : b + 1].clone()
        out = recurrent_gated_delta_rule(
            q[b : b + 1], k[b : b + 1], v[b : b + 1], g[b : b + 1], beta[b : b + 1], one
        )
        alone.append((out[0], one[0]))
    out = recurrent_gated_delta_rule(q, k, v, g, beta, states)
    for b, (o, s) in enumerate(alone):
        torch.testing.assert_close(out[b], o, **TOL)
        torch.testing.assert_close(cache[2 * b + 1], s, **TOL)
    assert cache[::2].isnan().all(), "the slots between this batch's stay untouched"


def test_recurrent_rule_refuses_a_state_that_is_not_float32():
    q, k, v, g, beta = _rule_inputs(_gen(7), 0, batch=1)
    with pytest.raises(ValueError, match="float32"):
        recurrent_gated_delta_rule(q, k, v, g, beta, torch.zeros(1, H, DK, DV, dtype=torch.bfloat16))


def test_rule_bfloat16_inputs_come_close_to_the_float32_reference():
    gen = _gen(8)
    q, k, v, g, beta = _rule_inputs(gen, 70)
    q, k, v, beta = (x.bfloat16() for x in (q, k, v, beta))
    state = torch.randn(H, DK, DV, generator=gen)
    out, final = chunk_gated_delta_rule(q, k, v, g, beta, state)
    ref, ref_final = chunk_gated_delta_rule(q.float(), k.float(), v.float(), g, beta.float(), state)
    assert out.dtype == torch.bfloat16 and final.dtype == torch.float32
    torch.testing.assert_close(out.float(), ref, **BF16_TOL)
    torch.testing.assert_close(final, ref_final, **TOL)
    step = [x[:2] for x in (q, k, v, g, beta)]
    states = torch.stack([final, final])
    ref_states = states.clone()
    out = recurrent_gated_delta_rule(*step, states)
    ref = recurrent_gated_delta_rule(*(x.float() for x in step), ref_states)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, **BF16_TOL)
    torch.testing.assert_close(states, ref_states, **TOL)
