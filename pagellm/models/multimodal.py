"""What a model that takes images adds to `CausalLM` (`SupportsImages`), and the op that puts the vision
encoder's output in place of the image placeholders' token embeddings.

The engine's side: the processor runs the checkpoint's own Hugging Face processor over the prompt and its
images (so resizing, normalisation and the expansion of each image's placeholder to its token count are the
model authors'), then asks the model class where each image's tokens are and which of the processor's
tensors belong to it (`image_inputs`). The model runner encodes an image (`encode_images`) in the step
whose prefill chunk first covers its tokens and hands the rows of the step's embeddings it replaces to the
forward in the context (`ImageBatch`); the decoder calls `merge_image_embeddings` after its token
embedding."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from pagellm.models.context import get_forward_context


class SupportsImages:
    """A `CausalLM` whose prompts may hold images. `image_token_id` is the placeholder the processor
    repeats once per image token."""

    supports_images: ClassVar[bool] = True

    @classmethod
    def image_token_id(cls, model_config: Any) -> int:
        return int(model_config.image_token_id)

    @classmethod
    def load_processor(cls, model_dir: str) -> Any:
        """The Hugging Face processor the engine runs over a prompt and its images."""
        from transformers import AutoProcessor

        return AutoProcessor.from_pretrained(model_dir)

    @classmethod
    def image_inputs(
        cls, model_config: Any, processed: Mapping[str, torch.Tensor], prompt_token_ids: list[int]
    ) -> list[tuple[int, int, dict[str, torch.Tensor]]]:
        """(offset, length, data) of each image, in prompt order: its placeholder tokens are positions
        [offset, offset + length) of `prompt_token_ids` (the processor's `input_ids`), and `data` holds the
        processor's tensors for that image alone, which `encode_images` reads. This default suits
        processors whose `pixel_values` hold one [C, H, W] image per row and expand each image to one run of
        placeholders (LLaVA, Gemma 3)."""
        runs = placeholder_runs(prompt_token_ids, cls.image_token_id(model_config))
        pixels = processed["pixel_values"]
        if len(runs) != pixels.shape[0]:
            raise ValueError(f"the prompt has {len(runs)} image placeholders for {pixels.shape[0]} images")
        return [
            (offset, length, {"pixel_values": pixels[i : i + 1]}) for i, (offset, length) in enumerate(runs)
        ]

    bidirectional_images: ClassVar[bool] = False
    """Whether an image's tokens attend to each other both ways in the decoder (Gemma 3): its attention
    specs then have `bidirectional_spans`, the scheduler never cuts an image's tokens across prefill chunks,
    the processor refuses an image longer than the token budget, and each step's attention batch names the
    images its chunks hold (`AttentionBatch.bidirectional`)."""

    uses_mrope: ClassVar[bool] = False
    """Whether the decoder's rope takes three positions per token (Qwen-VL's multimodal rope): the runner
    then hands the forward [3, T] positions from `mrope_positions` instead of [T]."""

    @classmethod
    def mrope_positions(
        cls, model_config: Any, prompt_token_ids: list[int], images: list[Any]
    ) -> tuple[torch.Tensor, int]:
        """With `uses_mrope`: the prompt's positions [3, P] int64 (the images' `ImageInput`s say where each
        image is and its grid), and the delta that every later token's position p becomes p + delta on
        all three axes (generated tokens are text)."""
        raise NotImplementedError

    def encode_images(
        self, images: list[dict[str, torch.Tensor]]
    ) -> list[torch.Tensor] | list[tuple[torch.Tensor, ...]]:
        """Each image's embeddings [length, hidden] in the model's dtype, in the order given; or, for a model
        whose encoder also feeds later decoder layers (Qwen3-VL's deepstack), a tuple per image: the
        embeddings, then one [length, hidden] tensor per such layer (`ImageBatch.deepstack`)."""
        raise NotImplementedError

    def image_encoder_modules(self) -> list[torch.nn.Module]:
        """The modules that run once per image rather than per token (the vision tower, the projector): the
        benchmarks' floor counts their work per image, not in the decoder's per-token work."""
        raise NotImplementedError


def placeholder_runs(token_ids: list[int], placeholder: int) -> list[tuple[int, int]]:
    """(start, length) of each maximal run of `placeholder` in `token_ids`."""
    runs: list[tuple[int, int]] = []
    for i, token in enumerate(token_ids):
        if token != placeholder:
            continue
        if runs and runs[-1][0] + runs[-1][1] == i:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return runs


def merge_image_embeddings(h: torch.Tensor) -> torch.Tensor:
    """The step's token embeddings with the image placeholders' rows replaced by the images' embeddings."""
    return torch.ops.pagellm.merge_image_embeddings(h)


@torch.library.custom_op("pagellm::merge_image_embeddings", mutates_args=())
def _merge_image_embeddings(h: torch.Tensor) -> torch.Tensor:
    """Opaque to torch.compile (like `pagellm::attention`): it reads the step's `ImageBatch` from the
    forward context, which a traced graph would otherwise freeze."""
    images = get_forward_context().images
    out = h.clone()
    if images is not None:
        out.index_copy_(0, images.rows, images.embeds.to(h.dtype))
    return out


@_merge_image_embeddings.register_fake
def _(h):
    return torch.empty_like(h)


def add_deepstack_embeddings(h: torch.Tensor, layer: int) -> torch.Tensor:
    """The hidden states `h` [T, hidden] with the step's deepstack rows of layer `layer` added to the image
    placeholders' rows (`ImageBatch.deepstack`); `h` unchanged in a step without them."""
    return torch.ops.pagellm.add_deepstack_embeddings(h, layer)


@torch.library.custom_op("pagellm::add_deepstack_embeddings", mutates_args=())
def _add_deepstack_embeddings(h: torch.Tensor, layer: int) -> torch.Tensor:
    """Opaque to torch.compile, as `pagellm::merge_image_embeddings` is."""
    images = get_forward_context().images
    out = h.clone()
    if images is not None and images.deepstack is not None:
        out[images.rows] = out[images.rows] + images.deepstack[layer].to(h.dtype)
    return out


@_add_deepstack_embeddings.register_fake
def _(h, layer):
    return torch.empty_like(h)
