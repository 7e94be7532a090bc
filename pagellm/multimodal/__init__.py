"""Media inputs (images) for multimodal models: reading them safely and keying them by content.

    from pagellm.multimodal import MediaError, MediaLimits, content_hash, load_image, load_image_async

    limits = MediaLimits(allowed_domains={"images.example.com"}, allowed_local_media_path="/srv/media")
    try:
        image = await load_image_async(part["image_url"]["url"], limits, field_hint="messages[0].content[1]")
    except MediaError as exc:  # a ValueError: the server answers 400 naming exc.field_hint
        ...
    key = content_hash(image)  # the prefix cache's key for this image's tokens

`load_image` takes a `data:image/...;base64,` URL, an `http(s)://` URL, a `file://` URL or a plain path, or
a PIL image (offline use); `load_image_bytes` takes encoded bytes. Each returns a fully loaded RGB
`PIL.Image.Image` or raises `MediaError` saying what was wrong. `MediaLimits` (limits.py) holds every bound
and the allowed sources; docs/multimodal.md describes them. This package imports only `pagellm.core`.
"""

from pagellm.multimodal.hashing import content_hash
from pagellm.multimodal.limits import MediaError, MediaLimits
from pagellm.multimodal.media import IMAGE_FORMATS, load_image, load_image_async, load_image_bytes

__all__ = [
    "IMAGE_FORMATS",
    "MediaError",
    "MediaLimits",
    "content_hash",
    "load_image",
    "load_image_async",
    "load_image_bytes",
]
