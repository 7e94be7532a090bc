"""The vision encoder's outputs of the running requests' images, kept from the step whose prefill chunk first
covers an image's tokens until the step that runs its last one.

Chunked prefill may cut an image's placeholder run across steps: the image is encoded once, at its first
chunk, and each chunk takes its rows of the output. A prefix-cache hit that covers part of an image leaves
only the rest to run, and the image is still encoded whole (the encoder sees the whole image; the rows the
hit covers are simply not used). A preempted or finished request's outputs are dropped; a preempted one
encodes again when it runs again."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import torch

from pagellm.models.context import ImageBatch
from pagellm.worker.step import ScheduledRequest


class EncoderCache:
    def __init__(self, model: torch.nn.Module, device: torch.device):
        self.model = model
        self.device = device
        # (request id, image index) -> the encoder's outputs for it, each [length, hidden]: the embeddings,
        # then any deepstack ones (`SupportsImages.encode_images`)
        self.outputs: dict[tuple[str, int], tuple[torch.Tensor, ...]] = {}

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
            for (rid, j, _), out in zip(missing, self.model.encode_images(data), strict=True):
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
