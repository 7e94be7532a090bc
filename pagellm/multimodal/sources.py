"""An image's encoded bytes, read from where a request says it is: a `data:` URL, an http(s) URL, a local file.

Each reader enforces `MediaLimits` before it reads more than it must: a data URL's length is checked before
its base64 is decoded, an HTTP body is counted as it streams in (Content-Length is a hint, not trusted), a
file's size is read from the file system first. A refused source is never read: a URL to a host off the
allow-list is not connected to, a path outside the allowed folder is not opened."""

from __future__ import annotations

import base64
import binascii
import ipaddress
import os
import socket
import stat
import time
from typing import TYPE_CHECKING
from urllib.parse import unquote, urlsplit

from pagellm.multimodal.limits import MediaError, MediaLimits, normalise_host

if TYPE_CHECKING:  # imported where a URL is fetched: 0.1 s of every engine's start otherwise
    import httpx

MAX_REDIRECTS = 5


def read_source(source: str, limits: MediaLimits, field_hint: str) -> bytes:
    """The encoded bytes `source` names: a `data:` URL, an `http(s)://` URL, a `file://` URL or a path."""
    if source[:5].lower() == "data:":
        return read_data_url(source, limits, field_hint)
    scheme = urlsplit(source).scheme.lower()
    if scheme in ("http", "https"):
        return fetch_http(source, limits, field_hint)
    if scheme == "file":
        return read_local(_file_url_path(source, field_hint), limits, field_hint)
    if scheme:
        raise MediaError(
            field_hint, f"unsupported URL scheme {scheme!r}: use a data: URL, http(s)://, file:// or a path"
        )
    return read_local(source, limits, field_hint)


def read_data_url(url: str, limits: MediaLimits, field_hint: str) -> bytes:
    """The bytes of a `data:image/...;base64,...` URL; its length is checked before decoding."""
    header, comma, payload = url[5:].partition(",")
    if not comma:
        raise MediaError(field_hint, "malformed data URL: no ',' between its header and its data")
    media_type, *params = header.split(";")
    media_type = media_type.strip().lower()
    if not media_type.startswith("image/"):
        raise MediaError(field_hint, f"data URL has media type {media_type or 'text/plain'!r}, not an image")
    if "base64" not in (p.strip().lower() for p in params):
        raise MediaError(field_hint, "data URL is not base64-encoded (expected 'data:image/...;base64,...')")
    payload = "".join(payload.split())  # clients wrap long base64 lines
    if len(payload) // 4 * 3 > limits.max_image_bytes + 2:
        raise too_many_bytes(field_hint, f"about {len(payload) // 4 * 3}", limits)
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise MediaError(field_hint, f"data URL is not valid base64: {exc}") from None
    if len(data) > limits.max_image_bytes:
        raise too_many_bytes(field_hint, str(len(data)), limits)
    return data


def fetch_http(url: str, limits: MediaLimits, field_hint: str) -> bytes:
    """GET `url`'s body, following at most MAX_REDIRECTS redirects, each hop checked against the limits.

    Redirects are followed here, not by httpx, so that a hop to a host the allow-list refuses is never
    connected to. Proxies from the environment are not used (trust_env=False): a proxy would resolve the
    host itself, past the public-address check."""
    import httpx

    deadline = time.monotonic() + limits.fetch_timeout_s
    with httpx.Client(follow_redirects=False, trust_env=False) as client:
        for _ in range(MAX_REDIRECTS + 1):
            target = _parse_url(url, field_hint)
            request_url, headers, extensions = _route(target, limits, field_hint)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise _timeout(field_hint, url, limits)
            try:
                with client.stream(
                    "GET",
                    request_url,
                    headers={"Accept-Encoding": "identity", **headers},
                    extensions=extensions,
                    timeout=remaining,
                ) as response:
                    if response.is_redirect:
                        url = str(target.join(response.headers["location"]))
                        continue
                    if response.status_code != 200:
                        raise MediaError(
                            field_hint, f"fetching {url} failed with HTTP status {response.status_code}"
                        )
                    return _read_body(response, url, deadline, limits, field_hint)
            except httpx.TimeoutException:
                raise _timeout(field_hint, url, limits) from None
            except httpx.HTTPError as exc:
                raise MediaError(field_hint, f"fetching {url} failed: {exc}") from None
    raise MediaError(field_hint, f"fetching {url} failed: more than {MAX_REDIRECTS} redirects")


def read_local(path: str, limits: MediaLimits, field_hint: str) -> bytes:
    """A local file's bytes, only if `path` resolves (symlinks and `..` followed) inside the allowed folder.

    A relative path is taken relative to that folder. The check is made on the resolved path before the
    file is opened, so a refused path is never read."""
    root = limits.local_root
    if root is None:
        raise MediaError(field_hint, "local files are not allowed (allowed_local_media_path is not set)")
    real = os.path.realpath(os.path.join(root, path))
    if os.path.commonpath([root, real]) != root:
        raise MediaError(field_hint, f"local path {path!r} is outside allowed_local_media_path")
    try:
        info = os.stat(real)
    except OSError:
        raise MediaError(field_hint, f"local file {path!r} does not exist or cannot be read") from None
    if not stat.S_ISREG(info.st_mode):
        raise MediaError(field_hint, f"local path {path!r} is not a regular file")
    if info.st_size > limits.max_image_bytes:
        raise too_many_bytes(field_hint, str(info.st_size), limits)
    try:
        with open(real, "rb") as f:
            data = f.read(limits.max_image_bytes + 1)
    except OSError as exc:
        raise MediaError(field_hint, f"local file {path!r} cannot be read: {exc.strerror}") from None
    if len(data) > limits.max_image_bytes:  # it grew since the stat
        raise too_many_bytes(field_hint, f"more than {limits.max_image_bytes}", limits)
    return data


def _file_url_path(url: str, field_hint: str) -> str:
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise MediaError(field_hint, f"file URL names host {parts.netloc!r}: only local files can be read")
    return unquote(parts.path)


def _parse_url(url: str, field_hint: str) -> httpx.URL:
    import httpx

    try:
        target = httpx.URL(url)
    except httpx.InvalidURL as exc:
        raise MediaError(field_hint, f"invalid URL {url!r}: {exc}") from None
    if target.scheme not in ("http", "https"):
        raise MediaError(field_hint, f"URL {url!r} is not http(s)")
    if not target.host:
        raise MediaError(field_hint, f"URL {url!r} has no host")
    return target


def _route(target: httpx.URL, limits: MediaLimits, field_hint: str) -> tuple[httpx.URL, dict, dict]:
    """Where to send the request for `target`, or a MediaError if the limits refuse its host.

    With an allow-list the host must be on it. Without one every address the host resolves to must be
    public, and the request goes to the first of them (the Host header and TLS name stay the host's), so a
    second lookup cannot return a private address in between (DNS rebinding)."""
    host = normalise_host(target.host)
    if limits.allowed_domains is not None:
        if host not in limits.allowed_domains:
            raise MediaError(field_hint, f"domain {host!r} is not allowed (not in allowed_domains)")
        return target, {}, {}
    addresses = _resolve(host, target.port or (443 if target.scheme == "https" else 80), field_hint)
    for address in addresses:
        if not _is_public(address):
            raise MediaError(
                field_hint,
                f"domain {host!r} is not allowed: it resolves to the non-public address {address} "
                "(name it in allowed_domains to fetch from it)",
            )
    extensions = {"sni_hostname": target.host} if target.scheme == "https" else {}
    return target.copy_with(host=addresses[0]), {"Host": target.netloc.decode("ascii")}, extensions


def _resolve(host: str, port: int, field_hint: str) -> list[str]:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise MediaError(field_hint, f"cannot resolve host {host!r}: {exc}") from None
    return list(dict.fromkeys(info[4][0] for info in infos))


def _is_public(address: str) -> bool:
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_global and not ip.is_multicast


def _read_body(
    response: httpx.Response, url: str, deadline: float, limits: MediaLimits, field_hint: str
) -> bytes:
    declared = response.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limits.max_image_bytes:
        raise too_many_bytes(field_hint, declared, limits)
    body = bytearray()
    for chunk in response.iter_bytes():
        body += chunk
        if len(body) > limits.max_image_bytes:
            raise too_many_bytes(field_hint, f"more than {limits.max_image_bytes}", limits)
        if time.monotonic() > deadline:
            raise _timeout(field_hint, url, limits)
    return bytes(body)


def too_many_bytes(field_hint: str, size: str, limits: MediaLimits) -> MediaError:
    """The error for an image of `size` bytes (a number or a bound) over `max_image_bytes`."""
    return MediaError(
        field_hint, f"image is too large: {size} bytes, the limit is {limits.max_image_bytes} bytes"
    )


def _timeout(field_hint: str, url: str, limits: MediaLimits) -> MediaError:
    return MediaError(field_hint, f"fetching {url} timed out after {limits.fetch_timeout_s} s")
