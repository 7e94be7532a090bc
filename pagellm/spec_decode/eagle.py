"""EAGLE-3 speculative decoding: a one-layer head (`eagle_head.py`) reads three of the target's hidden
states (the residual stream entering a low, a middle and a high decoder layer, `aux_hidden.py`) and drafts
k tokens in a chain (`head_proposer.py`)."""

from __future__ import annotations

from typing import Any

import torch

from pagellm.core.errors import ConfigError
from pagellm.spec_decode.aux_hidden import AuxHiddenStates, decoder_layers, default_aux_layer_ids
from pagellm.spec_decode.eagle_head import Eagle3Head, load_eagle3_head
from pagellm.spec_decode.head_proposer import ChainedHeadProposer
from pagellm.spec_decode.proposer import StepInputs


def load_eagle3(path: str, target: torch.nn.Module, init: Any) -> Eagle3Head:
    """The EAGLE-3 head of directory `path` for `target` (built with `init`, a `ModelInit`): refuses a
    target whose rotary takes several positions per token (the head's reads one)."""
    if getattr(target, "uses_mrope", False):
        raise ConfigError("speculative_config: eagle3 cannot run with a multimodal rope (Qwen-VL) target yet")
    embed = getattr(getattr(target, "model", None), "embed_tokens", None)
    return load_eagle3_head(path, init, embed)


class Eagle3Features:
    """What the head reads of a target step: `fc` of the three auxiliary hidden states, reported by a
    native step (`StepInputs.aux`) or caught by hooks on the target's layers during its forward."""

    def __init__(self, head: Eagle3Head, hooks: AuxHiddenStates):
        self.head = head
        self.hooks = hooks

    def __call__(self, step: StepInputs) -> torch.Tensor:
        aux = step.aux if step.aux is not None else self.hooks.take(step.input_ids.shape[0])
        return self.head.fc(aux)


def make_eagle3_proposer(
    head: Eagle3Head,
    target: torch.nn.Module,
    kv_caches: list[torch.Tensor],
    backend: Any,
    block_size: int,
    batch: Any,
    device: torch.device,
) -> ChainedHeadProposer:
    """The proposer, with hooks on the target's layers the head reads (its config's, else vLLM's default)."""
    ids = head.config.aux_layer_ids or default_aux_layer_ids(len(decoder_layers(target)))
    features = Eagle3Features(head, AuxHiddenStates(target, ids))
    proposer = ChainedHeadProposer("eagle3", head, features, kv_caches, backend, block_size, batch, device)
    proposer.aux_layers = tuple(ids)
    return proposer
