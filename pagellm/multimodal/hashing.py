"""An image's identity by content, for the prefix cache: two requests that send the same pixels (by any
URL, encoding or file name) share cached blocks, and a different image under the same text does not."""

from __future__ import annotations

import hashlib

from PIL import Image


def content_hash(image: Image.Image) -> str:
    """A hex digest (BLAKE2b, 256 bits) of the image's mode, size, palette (if any) and decoded pixels.

    The encoded bytes are not hashed: a PNG and a lossless WebP of the same pixels are one image to the
    model, and one pixel changed is another."""
    digest = hashlib.blake2b(digest_size=32)
    digest.update(f"{image.mode}:{image.width}x{image.height}:".encode())
    palette = image.getpalette() if image.mode in ("P", "PA") else None
    if palette is not None:
        digest.update(bytes(palette))
    digest.update(image.tobytes())
    return digest.hexdigest()
