"""Qwen2.5-VL (`Qwen2_5_VLForConditionalGeneration`): the window-attention vision encoder of
models/qwen_vision.py and a Qwen2 decoder (models/llama.py) with the multimodal rope. What Qwen3-VL
(models/qwen3_vl.py) shares with it is in `QwenVL`:

- An image is one run of `image_token_id` placeholders, (t x h x w) / merge^2 of them for its grid of
  patches; the processor's `pixel_values` hold every image's patches in a row and `image_grid_thw` each
  image's grid, so `image_inputs` cuts them per image.
- Multimodal rope (`mrope_positions`, as transformers' `get_rope_index` for images): a text token's three
  positions are equal and one more than the previous token's largest; an image's tokens take (t, row,
  column) of their merged grid, each offset by the position the image starts at, and the text after the
  image starts past its largest. Each token's rotary frequencies take their axis' position
  (`mrope_section`, layers/rotary.py). Generated tokens are text: position p + delta on every axis.

The vision encoder is not split over ranks, so the class runs without tensor or pipeline parallelism.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar

import torch

from pagellm.core.errors import ConfigError
from pagellm.models.base import ModelInit
from pagellm.models.llama import LlamaModel, Qwen2ForCausalLM
from pagellm.models.loader import copy_weights
from pagellm.models.multimodal import SupportsImages, merge_image_embeddings, placeholder_runs
from pagellm.models.qwen_vision import Qwen2_5VisionTransformer

PREFIXES = (("model.language_model.", "model."), ("model.visual.", "visual."))
"""transformers 5's layout (model.language_model.*, model.visual.*, lm_head.*) -> this class's; the
original checkpoints' (model.*, visual.*, lm_head.*) is this class's already."""


def checkpoint_name(name: str) -> str:
    for prefix, ours in PREFIXES:
        if name.startswith(prefix):
            return ours + name[len(prefix) :]
    return name


class QwenVLLanguageModel(LlamaModel):
    """The decoder, with the step's image embeddings in place of its placeholders' token embeddings."""

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return merge_image_embeddings(self.embed_tokens(input_ids))


class QwenVL(SupportsImages):
    """What Qwen2.5-VL and Qwen3-VL share besides their decoder class (a `LlamaForCausalLM` after this in
    the bases): the placement of images in the prompt, the multimodal rope's positions, the processor and
    the checkpoint's layout. A subclass names its vision encoder (`vision_class`, built as `visual`) and
    whether its rope interleaves the three axes' frequencies."""

    supports_parallel = False
    unsplit_layers = (
        "the vision encoder (`visual`: models/qwen_vision.py, models/qwen3_vision.py) has no split"
    )
    uses_mrope = True
    model_class = QwenVLLanguageModel
    vision_class: ClassVar[type[torch.nn.Module]]
    processor_class: ClassVar[str]
    """transformers' processor class, by name, for `images_only_processor`."""
    mrope_interleaved: ClassVar[bool] = False
    """transformers' Qwen3-VL interleaves the axes whatever its config says (layers/rotary.py)."""

    def __init__(self, init: ModelInit):
        c = init.model_config
        name = type(self).__name__
        if c is None:
            raise ConfigError(f"{name} needs the checkpoint's whole config (ModelInit.model_config)")
        params = init.hf_config.rope_parameters or {}
        if not params.get("mrope_section"):
            raise ConfigError(f"{name}'s text config has no rope_parameters.mrope_section")
        # transformers ties the output projection by the top-level flag, which a text_config may not repeat
        text = copy.copy(init.hf_config)
        text.tie_word_embeddings = bool(c.tie_word_embeddings)
        text.rope_parameters = {**params, "mrope_interleaved": self.mrope_interleaved}
        super().__init__(dataclasses.replace(init, hf_config=text))
        self.merge = c.vision_config.spatial_merge_size
        self.visual = self.vision_class(c.vision_config, init.dtype)

    @classmethod
    def load_processor(cls, model_dir: str) -> Any:
        """The checkpoint's processor; without torchvision (which transformers' Qwen video processors need)
        one for images alone, from the checkpoint's image processor, tokenizer and chat template."""
        from transformers import AutoProcessor

        try:
            return AutoProcessor.from_pretrained(model_dir)
        except ImportError:
            return images_only_processor(model_dir, cls.processor_class)

    @classmethod
    def image_inputs(
        cls, model_config: Any, processed: Mapping[str, torch.Tensor], prompt_token_ids: list[int]
    ) -> list[tuple[int, int, dict[str, torch.Tensor]]]:
        runs = placeholder_runs(prompt_token_ids, cls.image_token_id(model_config))
        grids = processed["image_grid_thw"]
        if len(runs) != grids.shape[0]:
            raise ValueError(f"the prompt has {len(runs)} image placeholders for {grids.shape[0]} images")
        merge = model_config.vision_config.spatial_merge_size
        out, first = [], 0
        for (offset, length), grid in zip(runs, grids, strict=True):
            patches = int(grid.prod())
            if length * merge * merge != patches:
                raise ValueError(f"an image of {patches} patches has {length} placeholders")
            pixels = processed["pixel_values"][first : first + patches]
            out.append((offset, length, {"pixel_values": pixels, "image_grid_thw": grid[None].clone()}))
            first += patches
        return out

    @classmethod
    def mrope_positions(
        cls, model_config: Any, prompt_token_ids: list[int], images: list[Any]
    ) -> tuple[torch.Tensor, int]:
        merge = model_config.vision_config.spatial_merge_size
        parts, start, done = [], 0, 0  # start: the next text token's position; done: tokens placed
        for image in sorted(images, key=lambda im: im.offset):
            text = image.offset - done
            parts.append(torch.arange(text).expand(3, -1) + start)
            start += text
            t, h, w = image_grid_of(image.data)
            h, w = h // merge, w // merge
            grid = torch.stack(
                torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
            )
            parts.append(grid.reshape(3, -1) + start)
            start += max(h, w)
            done = image.end
        parts.append(torch.arange(len(prompt_token_ids) - done).expand(3, -1) + start)
        positions = torch.cat(parts, dim=1)
        return positions, int(positions.max()) + 1 - len(prompt_token_ids)

    def image_encoder_modules(self) -> list[torch.nn.Module]:
        return [self.visual]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The decoder's weights through the Llama loader, the vision encoder's after them."""
        vision: list[tuple[str, torch.Tensor]] = []

        def decoder() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                name = checkpoint_name(name)
                if name.startswith("visual."):
                    vision.append((name, tensor))
                else:
                    yield name, tensor

        loaded = super().load_weights(decoder())
        return loaded | copy_weights(self, vision)


class Qwen2_5_VLForConditionalGeneration(QwenVL, Qwen2ForCausalLM):
    vision_class = Qwen2_5VisionTransformer
    processor_class = "Qwen2_5_VLProcessor"

    def encode_images(self, images: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """All images in one pass of the encoder (attention stays within each image)."""
        grids = [image_grid_of(image) for image in images]
        pixels = torch.cat([image["pixel_values"] for image in images])
        embeds = self.visual(pixels, grids)
        return list(embeds.split([t * h * w // self.merge**2 for t, h, w in grids]))


def image_grid_of(image: Mapping[str, torch.Tensor]) -> tuple[int, int, int]:
    """An image's grid (t, h, w) in patches, from its `image_inputs` data."""
    t, h, w = (int(x) for x in image["image_grid_thw"].reshape(3))
    return t, h, w


def images_only_processor(model_dir: str, processor_class: str) -> Any:
    """transformers' Qwen-VL processor (`processor_class`) built without its video processor: the same
    text expansion and image tensors for prompts with images."""
    import transformers
    from transformers import AutoImageProcessor, AutoTokenizer
    from transformers.processing_utils import ProcessorMixin

    class ImagesOnly(getattr(transformers, processor_class)):
        def __init__(self, image_processor: Any, tokenizer: Any, chat_template: str | None = None):
            self.image_token = getattr(tokenizer, "image_token", None) or "<|image_pad|>"
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.video_token, self.video_token_id = "<|video_pad|>", None
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return ImagesOnly(AutoImageProcessor.from_pretrained(model_dir), tokenizer, tokenizer.chat_template)
