"""The native decode updates of recurrent layers (platforms/cpu_kernels/recurrent.cpp) against the wrapped
plain-torch references (models/layers/recurrent_kernels.py's REFERENCE) on the same inputs: outputs, the
slots' new states, and every other slot's state left as it was; the platform's choice of them."""

from __future__ import annotations

import pytest
import torch

from pagellm.core.state import RecurrentKernels
from pagellm.models.layers.recurrent_kernels import REFERENCE
from pagellm.platforms import cpu
from pagellm.platforms.cpu import CpuPlatform

pytestmark = pytest.mark.usefixtures("two_threads")  # the kernels split their work across threads

NUM_SLOTS = 7


def _slots(batch: int, gen: torch.Generator) -> torch.Tensor:
    """`batch` distinct slots of NUM_SLOTS, out of order."""
    return torch.randperm(NUM_SLOTS, generator=gen)[:batch]


def _run_both(reference, kernel, states: torch.Tensor, slots: torch.Tensor, args):
    """(reference output, kernel output, the states after each), each run on its own copy of `states` with
    the arguments `args(states, slots)`; checks the slots not in the batch kept their states in the
    kernel's run."""
    ref_states, kernel_states = states.clone(), states.clone()
    expected = reference(*args(ref_states, slots))
    out = kernel(*args(kernel_states, slots))
    others = torch.ones(NUM_SLOTS, dtype=torch.bool)
    others[slots] = False
    assert torch.equal(kernel_states[others], states[others])
    return expected, out, ref_states, kernel_states


def _assert_out_close(out: torch.Tensor, expected: torch.Tensor) -> None:
    assert out.dtype == expected.dtype and out.shape == expected.shape
    if out.dtype == torch.bfloat16:  # float32 sums in another order: at most a rounding step apart
        torch.testing.assert_close(out.float(), expected.float(), rtol=2**-7, atol=1e-5)
    else:
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("batch", "heads", "dk", "dv"), [(5, 3, 16, 40), (1, 2, 32, 8), (4, 1, 8, 19)]
)  # dv of several vector widths and a remainder
@pytest.mark.parametrize(
    "dtypes",
    [(torch.float32,) * 3, (torch.bfloat16,) * 3, (torch.bfloat16, torch.bfloat16, torch.float32)],
    ids=["fp32", "bf16", "bf16-qk"],
)
def test_gated_delta_rule_update_matches_the_reference(kernels, batch, heads, dk, dv, dtypes):
    gen = torch.Generator().manual_seed(batch * 100 + dk + dv)
    q, k = (torch.randn(batch, heads, dk, generator=gen).to(dtypes[i]) for i in range(2))
    # v as the layer hands it over: a view of the conv's output, rows further apart than its heads
    v = torch.randn(batch, heads * dv + 3, generator=gen).to(dtypes[2])[:, 3:].unflatten(-1, (heads, dv))
    g = -torch.rand(batch, heads, generator=gen) * 2
    beta = torch.rand(batch, heads, generator=gen)
    states = torch.randn(NUM_SLOTS, heads, dk, dv, generator=gen)
    slots = _slots(batch, gen)
    expected, out, ref_states, kernel_states = _run_both(
        REFERENCE.gated_delta_rule_update,
        kernels.gated_delta_rule_update,
        states,
        slots,
        lambda s, sl: (q, k, v, g, beta, s, sl),
    )
    _assert_out_close(out, expected)
    torch.testing.assert_close(kernel_states, ref_states, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("heads", "groups"), [(4, 1), (6, 2), (3, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_selective_state_update_matches_the_reference(kernels, heads, groups, dtype):
    batch, head_dim, d_state = 4, 8, 24
    gen = torch.Generator().manual_seed(heads * 10 + groups)
    x = torch.randn(batch, heads, head_dim, generator=gen).to(dtype)
    dt = torch.randn(batch, heads, generator=gen) * 2
    dt[0, 0] = 25.0  # past softplus' threshold: dt itself
    b, c = (torch.randn(batch, groups, d_state, generator=gen).to(dtype) for _ in range(2))
    A = -torch.rand(heads, generator=gen) * 4
    D, dt_bias = torch.randn(heads, generator=gen), torch.randn(heads, generator=gen)
    states = torch.randn(NUM_SLOTS, heads, head_dim, d_state, generator=gen)
    slots = _slots(batch, gen)
    expected, out, ref_states, kernel_states = _run_both(
        REFERENCE.selective_state_update,
        kernels.selective_state_update,
        states,
        slots,
        lambda s, sl: (x, dt, A, b, c, D, dt_bias, s, sl),
    )
    _assert_out_close(out, expected)
    torch.testing.assert_close(kernel_states, ref_states, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("activation", ["silu", None])
@pytest.mark.parametrize("width", [4, 2])
def test_conv1d_update_matches_the_reference(kernels, dtype, bias, activation, width):
    batch, channels = 5, 37
    gen = torch.Generator().manual_seed(width * 4 + bias * 2 + (activation is None))
    x = torch.randn(batch, channels + 5, generator=gen).to(dtype)[:, 5:]  # a view, as the layer's is
    weight = torch.randn(channels, width, generator=gen).to(dtype)
    b = torch.randn(channels, generator=gen).to(dtype) if bias else None
    states = torch.randn(NUM_SLOTS, channels, width - 1, generator=gen).to(dtype)
    slots = _slots(batch, gen)
    expected, out, ref_states, kernel_states = _run_both(
        REFERENCE.conv1d_update,
        kernels.conv1d_update,
        states,
        slots,
        lambda s, sl: (x, weight, b, s, sl, activation),
    )
    _assert_out_close(out, expected)
    assert torch.equal(kernel_states, ref_states)  # the inputs, shifted: no arithmetic


def test_bad_slots_and_states_are_refused(kernels):
    q = k = v = torch.randn(2, 1, 8)
    g = beta = torch.zeros(2, 1)
    states = torch.zeros(3, 1, 8, 8)
    with pytest.raises(RuntimeError, match="out of range"):
        kernels.gated_delta_rule_update(q, k, v, g, beta, states, torch.tensor([0, 3]))
    with pytest.raises(RuntimeError, match="float32 state cache"):
        kernels.gated_delta_rule_update(q, k, v, g, beta, states.bfloat16(), torch.tensor([0, 1]))
    with pytest.raises(RuntimeError, match="activation silu or none"):
        kernels.conv1d_update(
            torch.randn(2, 4), torch.randn(4, 3), None, torch.zeros(3, 4, 2), torch.tensor([0, 1]), "gelu"
        )


def test_the_platform_runs_the_decode_updates_on_them(kernels, monkeypatch):
    chosen = CpuPlatform.recurrent_kernels()
    assert chosen.gated_delta_rule_update == kernels.gated_delta_rule_update
    assert chosen.selective_state_update == kernels.selective_state_update
    assert chosen.conv1d_update == kernels.conv1d_update
    assert chosen.chunk_gated_delta_rule is None  # prefill: the reference
    monkeypatch.setattr(cpu, "_kernels", lambda: None)  # no compiler: every reference
    assert CpuPlatform.recurrent_kernels() == RecurrentKernels()
