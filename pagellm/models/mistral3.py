"""The text model of Mistral's multimodal checkpoints (`Mistral3ForConditionalGeneration`: a Pixtral vision
tower, a projector and a decoder), for text-only requests. This is how Ministral 3 ships. The class's
decoder is told apart by its `text_config`'s model_type, not by the architecture name, so
`Mistral3ForConditionalGeneration` picks the decoder class from it (`TEXT_MODELS`: Ministral 3's, and
Mistral 4's, which transformers builds in this class as well); a decoder not listed (Mistral Small 3.1's
plain `mistral`, for one) is refused at start-up, naming it.

The engine runs the decoder's config (engine/setup.py), the decoder's weights are read under either layout
transformers has used (`language_model.model.*` and `language_model.lm_head.*`, as transformers 5 still
writes them; `model.language_model.*` and `lm_head.*`), and the vision tower's and projector's are not read.
Whether the output projection is the embedding is the top-level config's `tie_word_embeddings` (transformers
ties by it, and Mistral3Config's default is True), not the text config's.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch

from pagellm.core.attention import AttentionSpec
from pagellm.core.errors import ConfigError
from pagellm.models.base import CausalLM, ModelInit
from pagellm.models.ministral3 import Ministral3ForCausalLM
from pagellm.models.mistral4 import Mistral4ForCausalLM

RENAMES = (
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.language_model.", "model."),
)
SKIPPED = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


class TextOfMistral3:
    """Mixed in before a decoder class: the top-level tie flag, and the decoder's checkpoint names."""

    def __init__(self, init: ModelInit):
        text = copy.copy(init.hf_config)
        if init.model_config is not None:
            text.tie_word_embeddings = bool(getattr(init.model_config, "tie_word_embeddings", True))
        super().__init__(dataclasses.replace(init, hf_config=text))

    def _adapt(self, name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        if name.startswith(SKIPPED):
            return None
        for old, new in RENAMES:
            if name.startswith(old):
                name = new + name[len(old) :]
                break
        return super()._adapt(name, tensor)


class Ministral3TextOfMultimodal(TextOfMistral3, Ministral3ForCausalLM):
    """Ministral 3's decoder of a `Mistral3ForConditionalGeneration` checkpoint."""


class Mistral4TextOfMultimodal(TextOfMistral3, Mistral4ForCausalLM):
    """Mistral 4's decoder of a `Mistral3ForConditionalGeneration` checkpoint."""


TEXT_MODELS: dict[str, type[CausalLM]] = {
    "ministral3": Ministral3TextOfMultimodal,
    "mistral4": Mistral4TextOfMultimodal,
}
"""The decoders of a Mistral 3 checkpoint run here, by their text_config's model_type."""


def text_model_class(hf_config: Any) -> type[CausalLM]:
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in TEXT_MODELS:
        raise ConfigError(
            f"Mistral3ForConditionalGeneration with a {model_type!r} decoder is not supported; supported "
            f"decoders (text_config model_type): {', '.join(TEXT_MODELS)}"
        )
    return TEXT_MODELS[model_type]


class Mistral3ForConditionalGeneration(CausalLM):
    """Builds the decoder class of the checkpoint's text_config (`text_model_class`), and answers the
    engine's questions before the model exists (its attention specs) with that class's answers."""

    supports_parallel = True
    float_modules = ("kv_b_proj",)

    def __new__(cls, init: ModelInit) -> CausalLM:
        return text_model_class(init.hf_config)(init)

    @staticmethod
    def attention_spec(hf_config: Any, dtype: torch.dtype, block_size: int, layer_idx: int) -> AttentionSpec:
        return text_model_class(hf_config).attention_spec(hf_config, dtype, block_size, layer_idx)

    @classmethod
    def selection_spec(cls, hf_config: Any, dtype: torch.dtype, block_size: int) -> AttentionSpec:
        return text_model_class(hf_config).selection_spec(hf_config, dtype, block_size)

    @staticmethod
    def num_attention_layers(hf_config: Any) -> int:
        return text_model_class(hf_config).num_attention_layers(hf_config)
