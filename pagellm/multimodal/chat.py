"""Images in chat messages: the content parts OpenAI's API and vLLM's offline `LLM.chat` accept, turned into
what Hugging Face chat templates render (`{"type": "image"}` where the model's image placeholder goes) and the
images' sources in the order the template writes their placeholders."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagellm.core.errors import ConfigError


@dataclass(frozen=True)
class ImageSource:
    """Where a chat message's image comes from: a URL (data:, http(s):, file:) or a PIL image (offline), and
    the field that named it, for errors (`messages[0].content[1]`)."""

    source: Any
    field: str


def has_images(messages: list[dict[str, Any]]) -> bool:
    return any(
        isinstance(part, dict) and part.get("type") in IMAGE_PART_TYPES
        for message in messages
        if isinstance(message.get("content"), list)
        for part in message["content"]
    )


IMAGE_PART_TYPES = ("image_url", "image_pil")


def split_images(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[ImageSource]]:
    """(the messages as a chat template reads them, each one's image parts as `{"type": "image"}` and its
    text parts as `{"type": "text", "text": ...}`; the images' sources in order). A ConfigError names a part
    that is neither text nor an image."""
    out, images = [], []
    for i, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list):
            out.append(message)
            continue
        parts = []
        for j, part in enumerate(content):
            field = f"messages[{i}].content[{j}]"
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                parts.append({"type": "text", "text": str(part.get("text", ""))})
            elif kind == "image_url":
                url = part.get("image_url")
                url = url.get("url") if isinstance(url, dict) else url
                if not isinstance(url, str) or not url:
                    raise ConfigError(f"{field}: image_url needs a url", param=field)
                images.append(ImageSource(url, field))
                parts.append({"type": "image"})
            elif kind == "image_pil":
                images.append(ImageSource(part.get("image_pil"), field))
                parts.append({"type": "image"})
            else:
                raise ConfigError(
                    f"{field}: content parts of type {kind!r} are not supported; send text or image_url",
                    param=field,
                )
        out.append({**message, "content": parts})
    return out, images
