"""Qwen3-VL (`Qwen3VLForConditionalGeneration`, the dense models): the vision encoder of
models/qwen3_vision.py and a Qwen3 decoder (q/k norms, models/llama.py) with the multimodal rope.

What it shares with Qwen2.5-VL is in models/qwen_vl.py (`QwenVL`): images in the prompt, the processor,
the checkpoint's layout and the rope positions (transformers' Qwen3-VL `get_rope_index` places an image's
tokens as Qwen2.5-VL's does; its timestamps are for videos, which this class does not take). Two things
differ besides the encoder:

- The rope interleaves the three axes over the frequencies (`mrope_interleaved`, layers/rotary.py).
- Deepstack: the encoder's deepstack mergers give each image token one more embedding per entry of
  `deepstack_visual_indexes`, and the k-th is added to the token's hidden state after decoder layer k
  (transformers adds it to the residual stream after the layer, so the layer hands on the sum).

The vision encoder is not split over ranks, so the class runs without tensor or pipeline parallelism.
"""

from __future__ import annotations

import torch

from pagellm.models.base import ModelInit
from pagellm.models.llama import LlamaDecoderLayer, Qwen3ForCausalLM
from pagellm.models.multimodal import add_deepstack_embeddings
from pagellm.models.qwen3_vision import Qwen3VisionTransformer
from pagellm.models.qwen_vl import QwenVL, QwenVLLanguageModel, image_grid_of


class Qwen3VLDecoderLayer(LlamaDecoderLayer):
    """A decoder layer that, among the first len(deepstack_visual_indexes), adds its deepstack rows to the
    image tokens' residual stream after it."""

    def __init__(self, init: ModelInit, layer_idx: int, *args, **kwargs):
        super().__init__(init, layer_idx, *args, **kwargs)
        deepstack = len(init.model_config.vision_config.deepstack_visual_indexes)
        self.deepstack = layer_idx if layer_idx < deepstack else None

    def forward(
        self, h: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        h, residual = super().forward(h, residual, cos, sin)
        if self.deepstack is None:
            return h, residual
        # the stream is h + residual: summed here (as transformers sums it) before the rows are added
        return add_deepstack_embeddings(h + residual, self.deepstack), None


class Qwen3VLLanguageModel(QwenVLLanguageModel):
    layer_class = Qwen3VLDecoderLayer


class Qwen3VLForConditionalGeneration(QwenVL, Qwen3ForCausalLM):
    model_class = Qwen3VLLanguageModel
    vision_class = Qwen3VisionTransformer
    processor_class = "Qwen3VLProcessor"
    mrope_interleaved = True

    def encode_images(self, images: list[dict[str, torch.Tensor]]) -> list[tuple[torch.Tensor, ...]]:
        """All images in one pass of the encoder (attention stays within each image): per image its
        embeddings, then its deepstack embeddings in `deepstack_visual_indexes` order."""
        grids = [image_grid_of(image) for image in images]
        pixels = torch.cat([image["pixel_values"] for image in images])
        embeds, deepstack = self.visual(pixels, grids)
        sizes = [t * h * w // self.merge**2 for t, h, w in grids]
        return list(zip(*(x.split(sizes) for x in (embeds, *deepstack)), strict=True))
