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
    aux = AuxHiddenStates(target, ids)

    def features(step: StepInputs) -> torch.Tensor:
        return head.fc(aux.take(step.input_ids.shape[0]))

    return ChainedHeadProposer("eagle3", head, features, kv_caches, backend, block_size, batch, device)
