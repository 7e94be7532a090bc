"""Gemma 3 with images (`Gemma3ForConditionalGeneration`): a SigLIP vision tower (models/vision.py), the
multimodal projector, and the Gemma 3 text decoder (models/gemma.py), as transformers computes them:

- an image's features are SigLIP's last hidden state after its final layer norm; the projector averages
  them over square tiles of patches down to `mm_tokens_per_image` rows, normalises each row with Gemma's
  RMSNorm (`mm_soft_emb_norm`) and multiplies by `mm_input_projection_weight` [vision, text hidden]
- the decoder's token embeddings are scaled by sqrt(hidden_size) and the image rows then replace the
  placeholders' unscaled
- an image's tokens attend to each other both ways, in every layer (`bidirectional_images`): transformers'
  mask is OR(causal, same image) on global layers and AND(window, OR(causal, same image)) on local ones,
  which is `AttentionSpec.bidirectional_spans`. The scheduler runs an image's uncached tokens in one prefill
  chunk, so the keys a query may see are always in the cache or in the step.

The processor writes `\\n\\n<start_of_image>` + `mm_tokens_per_image` x `<image_soft_token>` +
`<end_of_image>\\n\\n` per image; the soft tokens are one run of placeholders (`SupportsImages.image_inputs`'
default). Pan-and-scan crops (off by default) would add runs the model does not pair with its images.

The vision tower is not split over ranks, so the class runs without tensor or pipeline parallelism.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.core.attention import AttentionSpec
from pagellm.core.errors import ConfigError
from pagellm.models.base import ModelInit
from pagellm.models.gemma import Gemma3ForCausalLM, GemmaModel, gemma3_attention_spec
from pagellm.models.layers.norm import GemmaRMSNorm
from pagellm.models.llava import TowerAndProjector
from pagellm.models.multimodal import SupportsImages, merge_image_embeddings
from pagellm.models.vision import VisionTransformer


def gemma3_mm_attention_spec(
    hf_config: Any, dtype: torch.dtype, block_size: int, layer_idx: int
) -> AttentionSpec:
    return dataclasses.replace(
        gemma3_attention_spec(hf_config, dtype, block_size, layer_idx), bidirectional_spans=True
    )


class Gemma3MultiModalLanguageModel(GemmaModel):
    """The decoder, with the step's image embeddings in place of its placeholders' scaled token embeddings."""

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return merge_image_embeddings(super().embed(input_ids))


class Gemma3MultiModalProjector(nn.Module):
    def __init__(self, model_config: Any, dtype: torch.dtype):
        super().__init__()
        vision, text = model_config.vision_config, model_config.text_config
        self.mm_input_projection_weight = nn.Parameter(
            torch.empty(vision.hidden_size, text.hidden_size, dtype=dtype), requires_grad=False
        )
        self.mm_soft_emb_norm = GemmaRMSNorm(vision.hidden_size, vision.layer_norm_eps, dtype)
        self.patches_per_side = vision.image_size // vision.patch_size
        tokens_per_side = int(model_config.mm_tokens_per_image**0.5)
        if tokens_per_side**2 != model_config.mm_tokens_per_image or self.patches_per_side % tokens_per_side:
            raise ConfigError(
                f"mm_tokens_per_image {model_config.mm_tokens_per_image} must be a square whose side divides "
                f"the tower's {self.patches_per_side} patches per side"
            )
        self.kernel = self.patches_per_side // tokens_per_side

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """[B, patches, vision hidden] -> [B, mm_tokens_per_image, text hidden]."""
        batch, _, width = features.shape
        grid = features.transpose(1, 2).reshape(batch, width, self.patches_per_side, self.patches_per_side)
        pooled = F.avg_pool2d(grid, self.kernel, self.kernel).flatten(2).transpose(1, 2)
        return self.mm_soft_emb_norm(pooled) @ self.mm_input_projection_weight


class Gemma3ForConditionalGeneration(TowerAndProjector, SupportsImages, Gemma3ForCausalLM):
    supports_parallel = False
    unsplit_layers = "the vision tower and projector (models/vision.py, models/gemma3_mm.py) have no split"
    bidirectional_images = True
    model_class = Gemma3MultiModalLanguageModel
    attention_spec = staticmethod(gemma3_mm_attention_spec)

    def __init__(self, init: ModelInit):
        c = init.model_config
        if c is None:
            raise ConfigError(
                "Gemma 3 with images needs the checkpoint's whole config (ModelInit.model_config)"
            )
        # transformers ties the output projection by the top-level flag, which a text_config may not repeat
        text = copy.copy(init.hf_config)
        text.tie_word_embeddings = bool(getattr(c, "tie_word_embeddings", True))
        super().__init__(dataclasses.replace(init, hf_config=text))
        vision = c.vision_config
        if vision.model_type != "siglip_vision_model":
            raise ConfigError(f"Gemma 3's vision tower must be SigLIP, not {vision.model_type!r}")
        self.vision_tower = VisionTransformer(
            vision, init.dtype, vision.num_hidden_layers + 1, post_layernorm=True
        )
        self.multi_modal_projector = Gemma3MultiModalProjector(c, init.dtype)

    def encode_images(self, images: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """All images in one batch: the processor resizes every image to the tower's `image_size`."""
        weight = self.vision_tower.embeddings.patch_embedding.weight
        pixels = torch.cat([image["pixel_values"] for image in images]).to(weight.device, weight.dtype)
        return list(self.multi_modal_projector(self.vision_tower.last_hidden_state(pixels)).unbind(0))
