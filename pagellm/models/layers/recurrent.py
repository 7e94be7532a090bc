"""The base of layers that keep per-sequence recurrent state (core/state.py) instead of a KV cache."""

from __future__ import annotations

from torch import nn

from pagellm.core.state import StateSpec


class RecurrentLayer(nn.Module):
    """A layer with a recurrent state per sequence. `state_idx` numbers the model's recurrent layers
    0..S-1 (as `Attention.layer_idx` numbers its attention layers); the runner allocates `state_spec()`'s
    tensors for it and hands them over in the forward context (`ForwardContext.state.caches[state_idx]`)."""

    # whether the layer keeps a way back from a step's drafts (`DraftReplay`), so that speculative decoding
    # can run on a model made of it
    replays_drafts = False

    def __init__(self, state_idx: int):
        super().__init__()
        self.state_idx = state_idx

    def state_spec(self) -> StateSpec:
        raise NotImplementedError

    def recurrent_flops_per_token(self) -> float:
        """FLOPs one token spends in the recurrence (reading and updating the state; the projections are
        linears, counted apart), for the benchmarks' floor."""
        raise NotImplementedError
