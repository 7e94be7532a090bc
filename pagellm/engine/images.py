"""A prompt's images made into `ImageInput`s by the checkpoint's own Hugging Face processor.

`AutoProcessor` resizes and normalises each image as the model's authors do and expands each image's
placeholder in the prompt text to the image's token count, so the prompt the scheduler sees already has its
real length: the token budget, max_model_len and the KV sizing count the image tokens. The model class then
says which placeholder run and which of the processor's tensors belong to each image
(`SupportsImages.image_inputs`), and each image is keyed by a hash of its pixels for the prefix cache.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from pagellm.core.errors import ConfigError
from pagellm.multimodal import MediaError, MediaLimits, content_hash, load_image
from pagellm.multimodal.inputs import ImageInput


class PromptImages:
    """The engine's image handling for one model: None of it runs for a model that takes no images."""

    def __init__(
        self,
        model_class: type,
        model_config: Any,
        model_dir: str,
        limit: int,
        max_image_tokens: int | None = None,
    ):
        """`max_image_tokens`: the most tokens one image may have (the token budget, for a model whose
        images run in one prefill chunk, `SupportsImages.bidirectional_images`); None: any."""
        self.model_class = model_class
        self.max_image_tokens = max_image_tokens
        self.model_config = model_config
        self.model_dir = model_dir
        self.limit = limit
        self._processor: Any = None
        self._lock = threading.Lock()

    @property
    def processor(self) -> Any:
        """The checkpoint's processor, loaded on the first image (a text-only engine never loads it)."""
        with self._lock:
            if self._processor is None:
                self._processor = self.model_class.load_processor(self.model_dir)
        return self._processor

    def process(
        self, text: str, images: Sequence[Any], add_special_tokens: bool = True
    ) -> tuple[list[int], list[ImageInput]]:
        """(prompt token ids with each image's placeholder expanded, the images in prompt order).

        `text` holds one placeholder per image where the image goes (the chat template writes them);
        `add_special_tokens`: whether the tokenizer adds its special tokens (BOS) as for any prompt; False
        for a chat template's output, which has them already."""
        if len(images) > self.limit:
            raise ConfigError(
                f"the prompt has {len(images)} images; at most {self.limit} are allowed per prompt "
                f"(--limit-mm-per-prompt '{{\"image\": N}}')",
                param="multi_modal_data",
            )
        loaded = [self._image(image, i) for i, image in enumerate(images)]
        try:
            processed = self.processor(
                text=[text], images=loaded, return_tensors="pt", add_special_tokens=add_special_tokens
            )
        except (ValueError, TypeError) as exc:  # e.g. fewer placeholders in the text than images
            raise ConfigError(
                f"the prompt and its images do not match: {exc}", param="multi_modal_data"
            ) from None
        token_ids = processed["input_ids"][0].tolist()
        try:
            placed = self.model_class.image_inputs(self.model_config, processed, token_ids)
        except ValueError as exc:
            raise ConfigError(str(exc), param="multi_modal_data") from None
        for i, (_, length, _) in enumerate(placed):
            if self.max_image_tokens is not None and length > self.max_image_tokens:
                raise ConfigError(
                    f"multi_modal_data.image[{i}] takes {length} tokens, more than max_num_batched_tokens "
                    f"({self.max_image_tokens}): this model's image tokens attend to each other both ways, so "
                    "an image runs in one step; raise max_num_batched_tokens",
                    param=f"multi_modal_data.image[{i}]",
                )
        inputs = [
            ImageInput(offset, length, content_hash(image), data)
            for (offset, length, data), image in zip(placed, loaded, strict=True)
        ]
        return token_ids, inputs

    def mrope(self, token_ids: list[int], images: list[ImageInput]) -> tuple[Any, int] | None:
        """A multimodal rope's prompt positions and decode delta (`SupportsImages.mrope_positions`); None
        for a model with a plain rope."""
        if not self.model_class.uses_mrope:
            return None
        positions, delta = self.model_class.mrope_positions(self.model_config, token_ids, images)
        return np.asarray(positions, dtype=np.int64), int(delta)

    @staticmethod
    def _image(image: Any, index: int) -> Any:
        """A PIL image as given, or one read from a data URL (offline callers may pass those too)."""
        from PIL import Image

        if isinstance(image, Image.Image):
            return image.convert("RGB") if image.mode != "RGB" else image
        if isinstance(image, str) and image.startswith("data:"):
            try:
                return load_image(image, MediaLimits(), field_hint=f"multi_modal_data.image[{index}]")
            except MediaError as exc:
                raise ConfigError(str(exc), param=f"multi_modal_data.image[{index}]") from None
        raise ConfigError(
            f"multi_modal_data.image[{index}]: expected a PIL image or a data: URL, not {type(image).__name__}",
            param="multi_modal_data",
        )
