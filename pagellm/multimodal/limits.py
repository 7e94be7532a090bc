"""What a media input may be and where it may come from, and the error every refusal raises.

One frozen `MediaLimits` is built from the server's flags (or an `LLM`'s arguments) and handed to every load,
so the loaders keep no settings of their own and two servers in one process may differ."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from pagellm.core.errors import ConfigError, PagellmError

MiB = 1024 * 1024


class MediaError(PagellmError, ValueError):
    """A media input that cannot be used: undecodable, not an image, too large, or from a place the limits
    refuse. `field_hint` names the input (the caller's name for it, e.g. `messages[0].content[1].image_url`)
    so a server can point at the part in its 400 without reading the message."""

    def __init__(self, field_hint: str, message: str):
        super().__init__(message)
        self.field_hint = field_hint
        self.message = message


@dataclass(frozen=True)
class MediaLimits:
    """Bounds on one image and the sources it may be read from.

    - `max_image_bytes`: the encoded image (the decoded body of a data URL, an HTTP body, a file) at most;
      an HTTP body is counted as it streams in and the fetch stops once it is passed.
    - `max_image_pixels`: width x height at most, read from the image's header before any pixel is decoded
      (the decompression-bomb guard: a few KiB of PNG can declare gigabytes of pixels).
    - `fetch_timeout_s`: the whole HTTP fetch, redirects included, is given up after this long (checked
      between reads; one read waits at most the time left when its hop began).
    - `allowed_domains`: the host names (exact, case-insensitive) an http(s) URL and each of its redirects
      may name; None allows any host whose addresses are all public (not loopback, private, link-local or
      reserved), and the connection then goes to the address that was checked.
    - `allowed_local_media_path`: a folder; `file://` URLs and plain paths are read only when they resolve
      (symlinks and `..` followed) inside it. None refuses every local file.
    """

    max_image_bytes: int = 20 * MiB
    max_image_pixels: int = 40_000_000
    fetch_timeout_s: float = 10.0
    allowed_domains: frozenset[str] | None = None  # any iterable of names is taken, kept as a frozenset
    allowed_local_media_path: str | None = None
    # the folder as checked against: allowed_local_media_path with its symlinks resolved
    _local_root: str | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self):
        for name in ("max_image_bytes", "max_image_pixels", "fetch_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)!r}", param=name)
        if self.allowed_domains is not None:
            if isinstance(self.allowed_domains, str):
                raise ConfigError(
                    "allowed_domains is a collection of host names, not one string", param="allowed_domains"
                )
            domains = frozenset(normalise_host(d) for d in self.allowed_domains)
            object.__setattr__(self, "allowed_domains", domains)
        if self.allowed_local_media_path is not None:
            root = os.path.realpath(self.allowed_local_media_path)
            if not os.path.isdir(root):
                raise ConfigError(
                    f"allowed_local_media_path {self.allowed_local_media_path!r} is not a folder",
                    param="allowed_local_media_path",
                )
            object.__setattr__(self, "_local_root", root)

    @property
    def local_root(self) -> str | None:
        """The allowed folder with its symlinks resolved, or None when local files are refused."""
        return self._local_root


def normalise_host(host: str) -> str:
    """A host as URLs are compared against the allow-list: lower case, no trailing dot, IPv6 unbracketed."""
    return host.strip().lower().rstrip(".").removeprefix("[").removesuffix("]")


def media_limits(config: Any) -> MediaLimits:
    """The limits an engine's settings give (`--allowed-local-media-path`, `--allowed-media-domains`)."""
    return MediaLimits(
        allowed_domains=config.allowed_media_domains,
        allowed_local_media_path=config.allowed_local_media_path,
    )
