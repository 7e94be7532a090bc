"""The kernels recurrent layers run: the platform's (`Platform.recurrent_kernels`) where it has one, the
plain-torch references of recurrent_ops.py and mamba_ops.py where it has none.

The references' decode ops take a batch of states; the kernels' decode ops take the whole state cache and the
step's slots (`RecurrentKernels` says why), so the references are wrapped here: gather the slots' states, update
the batch, scatter it back."""

from __future__ import annotations

import functools
from dataclasses import fields, replace

import torch

from pagellm.core.state import RecurrentKernels
from pagellm.models.layers.mamba_ops import selective_state_update, ssd_chunk_scan
from pagellm.models.layers.recurrent_ops import (
    causal_conv1d_decode,
    causal_conv1d_prefill,
    chunk_gated_delta_rule,
    recurrent_gated_delta_rule,
)


def _conv1d_update(x, weight, bias, conv_states, slots, activation) -> torch.Tensor:
    conv = conv_states.index_select(0, slots)
    y = causal_conv1d_decode(x, weight, bias, conv, activation)
    conv_states.index_copy_(0, slots, conv)
    return y


def _gated_delta_rule_update(q, k, v, g, beta, states, slots) -> torch.Tensor:
    batch = states.index_select(0, slots)
    out = recurrent_gated_delta_rule(q, k, v, g, beta, batch)
    states.index_copy_(0, slots, batch)
    return out


def _selective_state_update(x, dt, A, B, C, D, dt_bias, states, slots) -> torch.Tensor:
    batch = states.index_select(0, slots)
    y = selective_state_update(x, dt, A, B, C, D, dt_bias, batch)
    states.index_copy_(0, slots, batch)
    return y


REFERENCE = RecurrentKernels(
    conv1d_update=_conv1d_update,
    gated_delta_rule_update=_gated_delta_rule_update,
    selective_state_update=_selective_state_update,
    causal_conv1d_prefill=causal_conv1d_prefill,
    chunk_gated_delta_rule=chunk_gated_delta_rule,
    ssd_chunk_scan=ssd_chunk_scan,
)


@functools.cache
def complete(kernels: RecurrentKernels) -> RecurrentKernels:
    """`kernels` with every field it leaves None filled by the reference."""
    return replace(
        kernels,
        **{f.name: getattr(REFERENCE, f.name) for f in fields(kernels) if getattr(kernels, f.name) is None},
    )
