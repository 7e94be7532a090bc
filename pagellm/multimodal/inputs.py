"""A prompt's images as the engine carries them: each processed by the model's own processor, placed in the
prompt (its placeholder tokens already expanded to the image's token count) and keyed by content.

The processor (engine/processor.py) makes them; the scheduler counts their tokens like any prompt tokens;
the prefix cache keys a block by the images it overlaps (`block_image_keys`); the model runner encodes an
image in the step whose prefill chunk first covers its tokens and keeps the result until its last token has
run (worker/encoder_cache.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class ImageInput:
    """One image of a prompt: its placeholder tokens are prompt positions [offset, offset + length), whose
    embedding rows the model's vision encoder writes; `data` is what the encoder reads (the processor's
    tensors for this image alone, e.g. pixel_values [1, 3, H, W])."""

    offset: int
    length: int
    content_hash: str
    data: dict[str, torch.Tensor] = field(repr=False)

    @property
    def end(self) -> int:
        return self.offset + self.length


def block_image_keys(images: list[ImageInput], start: int, end: int) -> tuple[tuple[str, int], ...]:
    """What a KV block over prompt positions [start, end) depends on besides its tokens: the content of each
    image whose placeholders it overlaps, and where the image starts relative to the block (a block's
    placeholder ids are all the same token, so without this a different image under the same text would
    hit the cache)."""
    return tuple((im.content_hash, im.offset - start) for im in images if im.offset < end and im.end > start)
