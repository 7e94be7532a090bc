"""LLaVA (`LlavaForConditionalGeneration`): a CLIP or SigLIP vision tower (models/vision.py), a two-layer
MLP projector into the decoder's width, and a Llama, Mistral or Qwen2 decoder (models/llama.py) whose
image placeholder tokens take the projected patch features in place of their embeddings.

An image's features are the tower's hidden states of `vision_feature_layer` (one layer, or several
concatenated along the features), without the first row (CLIP's class embedding) with the "default"
`vision_feature_select_strategy`, all rows with "full"; then linear_1, `projector_hidden_act`, linear_2.
The processor repeats the placeholder once per row, so an image is one run of placeholders
(`SupportsImages.image_inputs`' default).

The vision tower is not split over ranks, so the class runs without tensor or pipeline parallelism.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterable

import torch
from torch import nn

from pagellm.core.errors import ConfigError
from pagellm.models.base import ModelInit
from pagellm.models.layers.activation import get_activation
from pagellm.models.layers.linear import Linear
from pagellm.models.llama import LlamaForCausalLM, LlamaModel
from pagellm.models.loader import copy_weights
from pagellm.models.multimodal import SupportsImages, merge_image_embeddings
from pagellm.models.vision import STACKED as VISION_STACKED
from pagellm.models.vision import VisionTransformer, hidden_state_indices

DECODERS = {"llama": None, "mistral": None, "qwen2": True}
"""The decoders' `model_type`s, with their bias on q/k/v (None: the config's `attention_bias`)."""

STRATEGIES = ("default", "full")

PREFIXES = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.vision_tower.vision_model.", "vision_tower."),
    ("vision_tower.vision_model.", "vision_tower."),
    ("model.vision_tower.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
)
"""Checkpoint prefixes -> this class's, the first that matches: LLaVA checkpoints come in the original
layout (language_model.model.*, language_model.lm_head.*, vision_tower.vision_model.*), in transformers
4.52+'s (model.language_model.*, model.vision_tower.vision_model.*, model.multi_modal_projector.*,
lm_head.*) and as transformers 5 saves them (the original's, the tower without vision_model.)."""


def checkpoint_name(name: str) -> str:
    """Checkpoint tensor `name` in this class's layout."""
    for prefix, ours in PREFIXES:
        if name.startswith(prefix):
            return ours + name[len(prefix) :]
    return name


class LlavaLanguageModel(LlamaModel):
    """The decoder, with the step's image embeddings in place of its placeholders' token embeddings."""

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return merge_image_embeddings(self.embed_tokens(input_ids))


class LlavaMultiModalProjector(nn.Module):
    def __init__(self, in_features: int, hidden_size: int, act: str, bias: bool, dtype: torch.dtype):
        super().__init__()
        self.linear_1 = Linear(in_features, hidden_size, bias, dtype)
        self.act = get_activation(act)
        self.linear_2 = Linear(hidden_size, hidden_size, bias, dtype)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(features)))


class TowerAndProjector:
    """What a model with LLaVA's layout (a decoder, `vision_tower.*`, `multi_modal_projector.*`; Gemma 3's
    too) adds to its decoder class: the tower and projector as the per-image modules, and their weights
    loaded after the decoder's own loader has taken the rest. Goes first among the bases."""

    def image_encoder_modules(self) -> list[nn.Module]:
        return [self.vision_tower, self.multi_modal_projector]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The decoder's weights through its class's loader, the tower's and the projector's after them."""
        vision: list[tuple[str, torch.Tensor]] = []

        def decoder() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                name = checkpoint_name(name)
                if name.startswith(("vision_tower.", "multi_modal_projector.")):
                    vision.append((name, tensor))
                else:
                    yield name, tensor

        loaded = super().load_weights(decoder())
        return loaded | copy_weights(self, vision, VISION_STACKED, self._adapt_vision)

    def _adapt_vision(self, name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        tower, _, rest = name.partition(".")
        if tower == "vision_tower" and not self.vision_tower.keeps(rest):
            return None
        return name, tensor


class LlavaForConditionalGeneration(TowerAndProjector, SupportsImages, LlamaForCausalLM):
    supports_parallel = False
    unsplit_layers = "the vision tower and projector (models/vision.py, models/llava.py) have no split"
    model_class = LlavaLanguageModel

    def __init__(self, init: ModelInit):
        c = init.model_config
        if c is None:
            raise ConfigError("LLaVA needs the checkpoint's whole config (ModelInit.model_config)")
        if c.text_config.model_type not in DECODERS:
            raise ConfigError(
                f"LLaVA with a {c.text_config.model_type!r} decoder is not supported; supported: "
                f"{', '.join(DECODERS)}"
            )
        if c.vision_feature_select_strategy not in STRATEGIES:
            raise ConfigError(
                f"vision_feature_select_strategy {c.vision_feature_select_strategy!r} is not supported; "
                f"supported: {', '.join(STRATEGIES)}"
            )
        self.qkv_bias = DECODERS[c.text_config.model_type]
        # transformers ties the output projection by the top-level flag, which a text_config may not repeat
        text = copy.copy(init.hf_config)
        text.tie_word_embeddings = bool(c.tie_word_embeddings)
        super().__init__(dataclasses.replace(init, hf_config=text))
        vision = c.vision_config
        self.feature_states = hidden_state_indices(c.vision_feature_layer, vision.num_hidden_layers)
        # the first row whatever the tower, as transformers does: SigLIP's first patch (it has no class row)
        self.drop_first_row = c.vision_feature_select_strategy == "default"
        self.vision_tower = VisionTransformer(vision, init.dtype, max(self.feature_states) + 1)
        self.multi_modal_projector = LlavaMultiModalProjector(
            vision.hidden_size * len(self.feature_states),
            init.hf_config.hidden_size,
            c.projector_hidden_act,
            getattr(c, "multimodal_projector_bias", True),
            init.dtype,
        )

    def encode_images(self, images: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """All images in one batch: LLaVA's processor resizes every image to the tower's `image_size`."""
        weight = self.vision_tower.embeddings.patch_embedding.weight
        pixels = torch.cat([image["pixel_values"] for image in images]).to(weight.device, weight.dtype)
        states = self.vision_tower(pixels)
        features = torch.cat([states[i] for i in self.feature_states], dim=-1)
        if self.drop_first_row:
            features = features[:, 1:]
        batch, rows, width = features.shape
        embeds = self.multi_modal_projector(features.reshape(-1, width))
        return list(embeds.view(batch, rows, -1).unbind(0))
