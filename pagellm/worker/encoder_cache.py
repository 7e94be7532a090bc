"""The vision encoder's outputs of the running requests' images, kept from the step whose prefill chunk first
covers an image's tokens until the step that runs its last one.

Chunked prefill may cut an image's placeholder run across steps: the image is encoded once, at its first
chunk, and each chunk takes its rows of the output. A prefix-cache hit that covers part of an image leaves
only the rest to run, and the image is still encoded whole (the encoder sees the whole image; the rows the
hit covers are simply not used). A preempted or finished request's outputs are dropped; a preempted one
encodes again when it runs again."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence

import numpy as np
import torch

from pagellm.models.context import ImageBatch
from pagellm.worker.step import ScheduledRequest

logger = logging.getLogger("pagellm")


class _ImageEncoder(torch.nn.Module):
    """A model's `encode_images` as a module's forward, which is what the platform compiles."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, images: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        return self.model.encode_images(images)


class EncoderCache:
    """`encode`: the model's `encode_images`, compiled by the platform where the text model is
    (`compile_with`, the platform's `compile_model`); a compiled encoder that fails runs eagerly from then
    on, with a warning."""

    def __init__(
        self,
        model: torch.nn.Module,
        device: torch.device,
        compile_with: Callable[[torch.nn.Module], Callable | None] | None = None,
    ):
        self.model = model
        self.device = device
        # (request id, image index) -> the encoder's outputs for it, each [length, hidden]: the embeddings,
        # then any deepstack ones (`SupportsImages.encode_images`)
        self.outputs: dict[tuple[str, int], tuple[torch.Tensor, ...]] = {}
        compiled = compile_with(_ImageEncoder(model)) if compile_with is not None else None
        self.encode: Callable[[list[dict[str, torch.Tensor]]], list[torch.Tensor]] = (
            self._guarded(compiled) if compiled is not None else model.encode_images
        )

    def _guarded(self, compiled: Callable) -> Callable:
        def encode(images: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
            try:
                return compiled(images)
            except Exception as e:  # an inductor or compiler failure: slower, not broken
                logger.warning(
                    "compiling the image encoder failed, running it eagerly: %s: %s", type(e).__name__, e
                )
                self.encode = self.model.encode_images
                return self.encode(images)

        return encode

    def step_images(
        self, scheduled: Sequence[ScheduledRequest], starts: Sequence[int], cu: np.ndarray
    ) -> ImageBatch | None:
        """The step's image rows and their embeddings (encoding the images first reached in this step, all
        in one call); None when no scheduled token is an image's."""
        overlaps = []  # (flat row of the first token, request id, image index, image, rows' slice in the image)
        for i, request in enumerate(scheduled):
            start, end = starts[i], starts[i] + int(cu[i + 1] - cu[i])
            for j, image in enumerate(getattr(request, "images", ())):
                lo, hi = max(start, image.offset), min(end, image.end)
                if lo < hi:
                    overlaps.append(
                        (int(cu[i]) + lo - start, request.request_id, j, image, lo - image.offset, hi)
                    )
        if not overlaps:
            return None
        missing = [(rid, j, image) for _, rid, j, image, _, _ in overlaps if (rid, j) not in self.outputs]
        if missing:
            data = [{k: v.to(self.device) for k, v in image.data.items()} for _, _, image in missing]
            for (rid, j, _), out in zip(missing, self.encode(data), strict=True):
                self.outputs[(rid, j)] = out if isinstance(out, tuple) else (out,)
        rows, parts = [], []
        for first_row, rid, j, image, first, hi in overlaps:
            rows.append(torch.arange(first_row, first_row + hi - image.offset - first))
            parts.append([out[first : hi - image.offset] for out in self.outputs[(rid, j)]])
            if hi == image.end:  # its last tokens run now: not needed again
                del self.outputs[(rid, j)]
        embeds, *deepstack = (torch.cat(part) for part in zip(*parts, strict=True))
        return ImageBatch(torch.cat(rows).to(self.device), embeds, deepstack or None)

    def release(self, request_ids: Iterable[str]) -> None:
        """Drop the outputs of requests preempted, finished or aborted."""
        gone = set(request_ids)
        for key in [key for key in self.outputs if key[0] in gone]:
            del self.outputs[key]
