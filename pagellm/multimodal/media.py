"""Images from what a request gives: a URL or path (`load_image`), encoded bytes (`load_image_bytes`) or a
PIL image (offline use), each decoded with pillow within `MediaLimits` and returned as a loaded RGB image.

Pillow's process-wide settings are left alone (`Image.MAX_IMAGE_PIXELS`, `LOAD_TRUNCATED_IMAGES`, warning
filters), so the limits are per call: the pixel count is read from the header after `Image.open` and checked
before `.load()` decodes a single pixel."""

from __future__ import annotations

import asyncio
import io

from PIL import Image, UnidentifiedImageError

from pagellm.multimodal.limits import MediaError, MediaLimits
from pagellm.multimodal.sources import read_source, too_many_bytes

# The formats an image may be in: those a chat client sends, decoded by pillow's own code. Formats pillow
# hands to other programs (EPS runs Ghostscript) or that are rarely photos are not tried.
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")


def load_image(source: str | Image.Image, limits: MediaLimits, *, field_hint: str = "image") -> Image.Image:
    """The RGB image `source` names: a `data:image/...;base64,...` URL, an `http(s)://` URL, a `file://`
    URL or a plain path (local files only inside `limits.allowed_local_media_path`), or a PIL image, taken
    as it is (converted to RGB if it is not). Raises MediaError(field_hint, ...) for any input it refuses.

    Blocks on the network and the decoder: in a server, use `load_image_async`."""
    if isinstance(source, Image.Image):
        source.load()  # an image from Image.open is decoded lazily
        return source if source.mode == "RGB" else source.convert("RGB")
    if not isinstance(source, str):
        raise MediaError(field_hint, f"an image is a URL, a path or a PIL image, not {type(source).__name__}")
    return load_image_bytes(read_source(source, limits, field_hint), limits, field_hint=field_hint)


async def load_image_async(
    source: str | Image.Image, limits: MediaLimits, *, field_hint: str = "image"
) -> Image.Image:
    """`load_image` in a worker thread, so the event loop keeps serving while an image is fetched and
    decoded."""
    return await asyncio.to_thread(load_image, source, limits, field_hint=field_hint)


def load_image_bytes(data: bytes, limits: MediaLimits, *, field_hint: str = "image") -> Image.Image:
    """The RGB image encoded in `data` (one of IMAGE_FORMATS), fully decoded; alpha is dropped."""
    if len(data) > limits.max_image_bytes:
        raise too_many_bytes(field_hint, str(len(data)), limits)
    try:
        image = Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)
    except UnidentifiedImageError:
        raise MediaError(field_hint, _unidentified(data)) from None
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise MediaError(
            field_hint, "image has too many pixels (pillow's decompression-bomb limit)"
        ) from None
    except (OSError, SyntaxError, ValueError) as exc:
        kind = " ".join(filter(None, [_format_of(data), "image"]))
        raise MediaError(field_hint, f"undecodable {kind}: {exc}") from None
    with image:
        width, height = image.size
        if width * height > limits.max_image_pixels:
            raise MediaError(
                field_hint,
                f"image has too many pixels: {width}x{height} = {width * height}, "
                f"the limit is {limits.max_image_pixels}",
            )
        try:
            image.load()
            return image.convert("RGB")
        except (Image.DecompressionBombError, Image.DecompressionBombWarning):
            raise MediaError(
                field_hint, "image has too many pixels (pillow's decompression-bomb limit)"
            ) from None
        except (OSError, SyntaxError, ValueError, EOFError) as exc:
            raise MediaError(field_hint, f"undecodable {image.format} image: {exc}") from None


# the first bytes of each of IMAGE_FORMATS, to tell a damaged image from something that is not one
_SIGNATURES = {
    b"\x89PNG\r\n\x1a\n": "PNG",
    b"\xff\xd8\xff": "JPEG",
    b"GIF8": "GIF",
    b"BM": "BMP",
    b"II*\x00": "TIFF",
    b"MM\x00*": "TIFF",
}


def _format_of(data: bytes) -> str | None:
    """The one of IMAGE_FORMATS whose signature `data` starts with, if any."""
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WEBP"
    return next((name for signature, name in _SIGNATURES.items() if data.startswith(signature)), None)


def _unidentified(data: bytes) -> str:
    """The error for bytes pillow did not recognise as any of IMAGE_FORMATS: what they look like."""
    if (name := _format_of(data)) is not None:
        return f"undecodable {name} image (corrupt or truncated)"
    if not data:
        return "not an image: the data is empty"
    if data.startswith(b"%PDF"):
        return "not an image: the data is a PDF document"
    head = data[:512]
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as exc:
        if exc.start < len(head) - 3:  # not only a character cut at the end
            return f"not an image: unrecognised data (formats read: {', '.join(IMAGE_FORMATS)})"
    return "not an image: the data is text"
