"""The Mamba-2 ops in `pagellm.models.layers.mamba_ops` against transformers' own torch references (GraniteMoeHybrid's
`mamba2_chunk_scan` and `mamba2_selective_state_update`), and against themselves: a prefill cut into pieces that
carry the returned state, decode steps after a prefill, and B sequences decoded together, each give what one pass
over the whole sequence gives."""

from __future__ import annotations

import pytest
import torch
from transformers.models.granitemoehybrid.modeling_granitemoehybrid import (
    mamba2_chunk_scan,
    mamba2_selective_state_update,
)

from pagellm.models.layers.mamba_ops import selective_state_update, ssd_chunk_scan

H, P, G, N = 4, 8, 2, 16  # heads, head dim, groups, state size
CHUNK = 16
TOL = {"atol": 1e-4, "rtol": 1e-4}


def _inputs(seed: int, length: int):
    """x [T, H, P], raw dt [T, H], B and C [T, G, N], and the layer's A (< 0), D and dt_bias [H]."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(length, H, P, generator=gen)
    dt = torch.randn(length, H, generator=gen)
    b = torch.randn(length, G, N, generator=gen)
    c = torch.randn(length, G, N, generator=gen)
    A = -torch.exp(torch.randn(H, generator=gen) * 0.5)
    D = torch.randn(H, generator=gen)
    dt_bias = torch.randn(H, generator=gen) * 0.5
    return x, dt, b, c, A, D, dt_bias


def _hf_scan(x, dt, b, c, A, D, dt_bias, state, dt_limit=(0.0, float("inf"))):
    y, final = mamba2_chunk_scan(
        x[None], dt[None], A, b[None], c[None], CHUNK, D=D, dt_bias=dt_bias, initial_states=state[None],
        dt_softplus=True, dt_limit=dt_limit, return_final_states=True,
    )  # fmt: skip
    return y[0], final[0]


def _hf_step(x, dt, b, c, A, D, dt_bias, state):
    """transformers' decode step over [B, ...] inputs, with its per-(head, P, N) expanded parameters."""
    return mamba2_selective_state_update(
        state, x, dt[..., None].expand(-1, -1, P), A[:, None, None].expand(-1, P, N), b, c,
        D[:, None].expand(-1, P), dt_bias=dt_bias[:, None].expand(-1, P), dt_softplus=True,
    )  # fmt: skip


@pytest.mark.parametrize("length", [1, 5, 16, 17, 50])
@pytest.mark.parametrize("fresh", [True, False])
def test_chunk_scan_matches_transformers(length, fresh):
    x, dt, b, c, A, D, dt_bias = _inputs(length, length)
    state = torch.zeros(H, P, N) if fresh else torch.randn(H, P, N)
    before = state.clone()
    y, final = ssd_chunk_scan(x, dt, A, b, c, D, dt_bias, state, CHUNK)
    ref_y, ref_final = _hf_scan(x, dt, b, c, A, D, dt_bias, state)
    torch.testing.assert_close(y, ref_y, **TOL)
    torch.testing.assert_close(final, ref_final, **TOL)
    assert torch.equal(state, before), "the state passed in is read, not written"


def test_chunk_scan_clamps_dt_to_the_limit_as_transformers():
    x, dt, b, c, A, D, dt_bias = _inputs(3, 40)
    state = torch.randn(H, P, N)
    y, final = ssd_chunk_scan(x, dt, A, b, c, D, dt_bias, state, CHUNK, dt_limit=(0.3, 0.9))
    ref_y, ref_final = _hf_scan(x, dt, b, c, A, D, dt_bias, state, dt_limit=(0.3, 0.9))
    torch.testing.assert_close(y, ref_y, **TOL)
    torch.testing.assert_close(final, ref_final, **TOL)


def test_chunk_scan_in_pieces_carrying_the_state_equals_one_pass():
    """Pieces of 7, 1, 20 and 12 tokens (shorter and longer than a chunk, cutting chunks mid-way)."""
    x, dt, b, c, A, D, dt_bias = _inputs(4, 40)
    whole_y, whole_final = ssd_chunk_scan(x, dt, A, b, c, D, dt_bias, torch.zeros(H, P, N), CHUNK)
    state, ys, start = torch.zeros(H, P, N), [], 0
    for piece in (7, 1, 20, 12):
        rows = slice(start, start + piece)
        y, state = ssd_chunk_scan(x[rows], dt[rows], A, b[rows], c[rows], D, dt_bias, state, CHUNK)
        ys.append(y)
        start += piece
    torch.testing.assert_close(torch.cat(ys), whole_y, **TOL)
    torch.testing.assert_close(state, whole_final, **TOL)


def test_decode_steps_after_a_prefill_match_transformers_and_one_longer_prefill():
    x, dt, b, c, A, D, dt_bias = _inputs(5, 30)
    _, state = ssd_chunk_scan(x[:25], dt[:25], A, b[:25], c[:25], D, dt_bias, torch.zeros(H, P, N), CHUNK)
    ours, theirs = state.clone()[None], state.clone()[None]
    for t in range(25, 30):
        step = (x[t : t + 1], dt[t : t + 1], b[t : t + 1], c[t : t + 1])
        y = selective_state_update(*step[:2], A, *step[2:], D, dt_bias, ours)
        torch.testing.assert_close(y, _hf_step(*step[:2], *step[2:], A, D, dt_bias, theirs), **TOL)
    whole_y, whole_final = ssd_chunk_scan(x, dt, A, b, c, D, dt_bias, torch.zeros(H, P, N), CHUNK)
    torch.testing.assert_close(y[0], whole_y[-1], **TOL)
    torch.testing.assert_close(ours[0], whole_final, **TOL)
    torch.testing.assert_close(ours, theirs, **TOL)


def test_batched_decode_equals_each_sequence_alone_and_updates_its_slots_in_place():
    """Three sequences with different states in a cache of five slots: no cross-talk, other slots untouched."""
    x, dt, b, c, A, D, dt_bias = _inputs(6, 3)
    cache = torch.randn(5, H, P, N)
    before = cache.clone()
    slots = torch.tensor([3, 0, 4])
    states = cache[slots]
    y = selective_state_update(x, dt, A, b, c, D, dt_bias, states)
    cache[slots] = states
    for i, slot in enumerate(slots.tolist()):
        alone = before[slot].clone()[None]
        expected = selective_state_update(
            x[i : i + 1], dt[i : i + 1], A, b[i : i + 1], c[i : i + 1], D, dt_bias, alone
        )
        torch.testing.assert_close(y[i : i + 1], expected, **TOL)
        torch.testing.assert_close(cache[slot], alone[0], **TOL)
    assert torch.equal(cache[[1, 2]], before[[1, 2]])


def test_decode_refuses_a_state_that_is_not_float32():
    x, dt, b, c, A, D, dt_bias = _inputs(7, 1)
    with pytest.raises(ValueError, match="float32"):
        selective_state_update(x, dt, A, b, c, D, dt_bias, torch.zeros(1, H, P, N, dtype=torch.bfloat16))


def test_bfloat16_inputs_come_close_to_the_float32_reference():
    """bfloat16 activations are computed in float32 (the state stays float32) and come back in bfloat16."""
    x, dt, b, c, A, D, dt_bias = _inputs(8, 40)
    state = torch.randn(H, P, N)
    y, final = ssd_chunk_scan(*(t.bfloat16() for t in (x, dt, A, b, c, D, dt_bias)), state, CHUNK)
    rounded = (t.bfloat16().float() for t in (x, dt, A, b, c, D, dt_bias))
    ref_y, ref_final = ssd_chunk_scan(*rounded, state, CHUNK)
    assert y.dtype == torch.bfloat16 and final.dtype == torch.float32
    torch.testing.assert_close(y.float(), ref_y, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(final, ref_final, **TOL)
