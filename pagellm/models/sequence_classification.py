"""`*ForSequenceClassification` checkpoints of the Llama family (Llama, Mistral, Qwen2, Qwen3): the decoder
with a `score` layer (hidden -> num_labels, no bias) in place of the language-model head, read at the last
token by the pooling runner's classify requests (`worker/pooler.py`).

With `classifier_from_token` in the config (vLLM's hf_overrides for a causal-LM reranker such as
Qwen3-Reranker) the checkpoint is a causal LM: the model keeps its language-model head and the classifier's
logits are that head's at the named tokens (`core.pooling.Classifier`).
"""

from __future__ import annotations

import copy
import dataclasses

import torch

from pagellm.models.base import ModelInit
from pagellm.models.layers.linear import Linear
from pagellm.models.llama import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM


class SequenceClassification:
    """Mixed in before a causal-LM class: its decoder, and a replicated `score` head unless the classifier
    reads the vocabulary (`classifier_from_token`)."""

    def __init__(self, init: ModelInit):
        c = init.hf_config
        if getattr(c, "classifier_from_token", None):
            super().__init__(init)  # type: ignore[call-arg]
            self.score = None
            return
        tied = copy.copy(c)  # built tied, so no vocabulary-sized head is allocated only to be dropped
        tied.tie_word_embeddings = True
        super().__init__(dataclasses.replace(init, hf_config=tied))  # type: ignore[call-arg]
        self.tied = False
        self.lm_head = None
        self.score = Linear(c.hidden_size, c.num_labels, False, init.dtype)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, num_labels] from the score head, or the vocabulary's logits for `classifier_from_token`."""
        if self.score is None:
            return super().compute_logits(hidden)  # type: ignore[misc]
        return self.score(hidden)


class LlamaForSequenceClassification(SequenceClassification, LlamaForCausalLM):
    pass


class MistralForSequenceClassification(SequenceClassification, MistralForCausalLM):
    pass


class Qwen2ForSequenceClassification(SequenceClassification, Qwen2ForCausalLM):
    pass


class Qwen3ForSequenceClassification(SequenceClassification, Qwen3ForCausalLM):
    pass
