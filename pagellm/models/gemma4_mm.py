"""Gemma 4 with images (`Gemma4ForConditionalGeneration`, how Gemma 4 ships): the vision encoder and its
embedder (models/gemma4_vision.py) and the Gemma 4 decoder (models/gemma4.py), as transformers'
`Gemma4Model` joins them:

- the processor writes `<start_of_image>`, one `<image_soft_token>` per soft token (the image's patches /
  pooling_kernel_size², so the count follows the image's aspect ratio) and `<end_of_image>` per image; the
  soft tokens are one run of placeholders, whose rows the image's embeddings replace after the decoder's
  scaled token embedding
- transformers embeds each placeholder as the pad token first: the per-layer inputs (E2B, E4B) read the pad
  token's row of their table, and their projection reads the merged embeddings (the image's rows)
- with `use_bidirectional_attention` "vision" an image's tokens attend to each other both ways on the
  sliding-window layers only (AND(window, OR(causal, same image))); the full layers stay causal, unlike
  Gemma 3's. The scheduler runs an image's uncached tokens in one prefill chunk (`bidirectional_images`),
  whichever the config says, so an image longer than the token budget is refused either way

Audio and video are not run: the engine takes images alone, a prompt holding the audio or video
placeholders is refused, and the towers' weights for them are not read. Without torchvision (which
transformers' Gemma 4 video processor needs, and `Gemma4Processor` cannot be built without one) the
processor is built for images alone, from the checkpoint's image processor (its PIL form), tokenizer
and chat template: the same text expansion and image tensors.

A checkpoint without a `vision_config` runs as the text model it is (`Gemma4TextOfMultimodal`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from pagellm.core.attention import AttentionSpec
from pagellm.core.errors import ConfigError
from pagellm.models.base import ModelInit
from pagellm.models.gemma4 import Gemma4Model, Gemma4TextOfMultimodal, gemma4_attention_spec
from pagellm.models.gemma4_vision import Gemma4MultimodalEmbedder, Gemma4VisionModel
from pagellm.models.llama import SpecFn
from pagellm.models.loader import copy_weights
from pagellm.models.multimodal import SupportsImages, merge_image_embeddings, placeholder_runs

VISION_PREFIXES = ("model.vision_tower.", "model.embed_vision.")


def gemma4_mm_attention_spec(
    hf_config: Any, dtype: torch.dtype, block_size: int, layer_idx: int
) -> AttentionSpec:
    spec = gemma4_attention_spec(hf_config, dtype, block_size, layer_idx)
    vision = getattr(hf_config, "use_bidirectional_attention", None) == "vision"
    return dataclasses.replace(spec, bidirectional_spans=vision and spec.sliding_window is not None)


class Gemma4MultimodalLanguageModel(Gemma4Model):
    """The decoder, its image placeholders embedded as the pad token and then replaced by the step's image
    embeddings."""

    def __init__(self, init: ModelInit, qkv_bias: bool, qk_norm: bool, spec_fn: SpecFn):
        super().__init__(init, qkv_bias, qk_norm, spec_fn)
        self.image_token_id = int(init.model_config.image_token_id)
        self.pad_token_id = int(init.hf_config.pad_token_id or 0)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return merge_image_embeddings(super().embed(input_ids))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        ids = torch.where(input_ids == self.image_token_id, self.pad_token_id, input_ids)
        return super().forward(ids, positions)


class Gemma4ForConditionalGeneration(SupportsImages, Gemma4TextOfMultimodal):
    unsplit_layers = "the vision encoder (models/gemma4_vision.py) has no split, nor do the decoder's layers"
    bidirectional_images = True
    model_class = Gemma4MultimodalLanguageModel
    attention_spec = staticmethod(gemma4_mm_attention_spec)

    def __init__(self, init: ModelInit):
        c = init.model_config
        if c is None:
            raise ConfigError(
                "Gemma 4 with images needs the checkpoint's whole config (ModelInit.model_config)"
            )
        super().__init__(init)
        self.vision_tower: Gemma4VisionModel | None = None
        self.embed_vision: Gemma4MultimodalEmbedder | None = None
        if c.vision_config is not None:
            self.vision_tower = Gemma4VisionModel(c.vision_config, init.dtype)
            self.embed_vision = Gemma4MultimodalEmbedder(c.vision_config, c.text_config, init.dtype)

    @classmethod
    def load_processor(cls, model_dir: str) -> Any:
        """The checkpoint's processor; without torchvision one for images alone (`images_only_processor`)."""
        from transformers import AutoProcessor

        try:
            return AutoProcessor.from_pretrained(model_dir)
        except ImportError:
            return images_only_processor(model_dir)

    @classmethod
    def image_inputs(
        cls, model_config: Any, processed: Mapping[str, torch.Tensor], prompt_token_ids: list[int]
    ) -> list[tuple[int, int, dict[str, torch.Tensor]]]:
        """Each image's patches and their positions (padded to the processor's budget), checked against
        its run of placeholders: one per kernel² patches."""
        if model_config.vision_config is None:
            raise ValueError("this Gemma 4 checkpoint has no vision tower: it takes no images")
        others = {getattr(model_config, f"{m}_token_id", None) for m in ("audio", "video")} - {None}
        if others & set(prompt_token_ids):
            raise ValueError(
                "the prompt holds Gemma 4's audio or video placeholders; pagellm runs images only"
            )
        runs = placeholder_runs(prompt_token_ids, cls.image_token_id(model_config))
        pixels, positions = processed["pixel_values"], processed["image_position_ids"]
        if len(runs) != pixels.shape[0]:
            raise ValueError(f"the prompt has {len(runs)} image placeholders for {pixels.shape[0]} images")
        kernel = model_config.vision_config.pooling_kernel_size**2
        out = []
        for i, (offset, length) in enumerate(runs):
            patches = int((positions[i] != -1).all(dim=-1).sum())
            if patches != length * kernel:
                raise ValueError(f"an image of {patches} patches has {length} placeholders")
            data = {"pixel_values": pixels[i : i + 1], "image_position_ids": positions[i : i + 1]}
            out.append((offset, length, data))
        return out

    def encode_images(self, images: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """All images in one batch (the processor pads each to the same patch budget); the pixels enter
        the encoder in float32, which maps them to [-1, 1] before its cast, as transformers does."""
        if self.vision_tower is None:
            raise ConfigError("this Gemma 4 checkpoint has no vision tower: it takes no images")
        device = next(self.vision_tower.parameters()).device  # (the embedder's weight may be packed away)
        pixels = torch.cat([image["pixel_values"] for image in images]).to(device, torch.float32)
        positions = torch.cat([image["image_position_ids"] for image in images]).to(device)
        return [self.embed_vision(rows) for rows in self.vision_tower(pixels, positions)]

    def image_encoder_modules(self) -> list[nn.Module]:
        return [self.vision_tower, self.embed_vision]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The decoder's weights through Gemma 4's loader, then the encoder's and the embedder's under
        their own names (their q/k/v stay apart: the decoder's fusing of them does not apply)."""
        vision: list[tuple[str, torch.Tensor]] = []

        def decoder() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if name.startswith(VISION_PREFIXES) and self.vision_tower is not None:
                    vision.append((name.removeprefix("model."), tensor))
                else:
                    yield name, tensor

        return super().load_weights(decoder()) | copy_weights(self, vision)


def images_only_processor(model_dir: str) -> Any:
    """transformers' `Gemma4Processor` built without its feature extractor and video processor, for
    prompts with images: its placeholder expansion, token types and the image processor's tensors."""
    from transformers import AutoImageProcessor, AutoTokenizer, Gemma4Processor
    from transformers.processing_utils import ProcessorMixin

    class ImagesOnly(Gemma4Processor):
        def __init__(
            self,
            image_processor: Any,
            tokenizer: Any,
            chat_template: str | None = None,
            image_seq_length: int = 280,
        ):
            self.image_seq_length = image_seq_length
            self.image_token_id, self.image_token = tokenizer.image_token_id, tokenizer.image_token
            self.boi_token, self.eoi_token = tokenizer.boi_token, tokenizer.eoi_token
            self.video_token = self.video_token_id = self.audio_token = self.audio_token_id = None
            # transformers' input check refuses any call while these are unset, audio or not
            self.boa_token = getattr(tokenizer, "boa_token", None) or "<start_of_audio>"
            self.eoa_token = getattr(tokenizer, "eoa_token", None) or "<end_of_audio>"
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    image_processor = AutoImageProcessor.from_pretrained(model_dir, backend="pil")
    return ImagesOnly(image_processor, tokenizer, tokenizer.chat_template)
