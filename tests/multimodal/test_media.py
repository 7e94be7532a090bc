"""pagellm.multimodal: images load from data URLs, http(s) and allowed local files within MediaLimits, every
bad input is a MediaError naming what was wrong, and a refused URL or path is never read. HTTP goes to a
server on 127.0.0.1 in a thread; nothing leaves the machine."""

from __future__ import annotations

import asyncio
import base64
import http.server
import io
import os
import random
import struct
import threading
import time
import zlib
from urllib.parse import parse_qs, urlsplit

import pytest
from PIL import Image, ImageFile

from pagellm.core.errors import ConfigError, PagellmError
from pagellm.multimodal import (
    MediaError,
    MediaLimits,
    content_hash,
    load_image,
    load_image_async,
    load_image_bytes,
    sources,
)


def encode(image: Image.Image, fmt: str, **kwargs) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **kwargs)
    return buffer.getvalue()


def gradient(width: int = 32, height: int = 24) -> Image.Image:
    """An image with a different colour in each pixel, noisy enough that its PNG is a few KiB."""
    noise = random.Random(0)
    image = Image.new("RGB", (width, height))
    image.putdata([(x * 8, y * 10, noise.randrange(256)) for y in range(height) for x in range(width)])
    return image


PNG = encode(gradient(), "PNG")


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def refused(source, limits: MediaLimits, *words: str) -> MediaError:
    with pytest.raises(MediaError) as info:
        load_image(source, limits, field_hint="messages[0].content[1]")
    assert info.value.field_hint == "messages[0].content[1]"
    for word in words:
        assert word in str(info.value), str(info.value)
    return info.value


# --- decoding ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF"])
def test_an_encoded_image_loads_as_rgb(fmt):
    image = load_image_bytes(encode(gradient(), fmt), MediaLimits())
    assert image.mode == "RGB" and image.size == (32, 24)
    if fmt == "PNG":
        assert image.tobytes() == gradient().tobytes()


def test_alpha_and_palette_images_come_back_rgb():
    rgba = Image.new("RGBA", (5, 4), (10, 20, 30, 128))
    assert load_image_bytes(encode(rgba, "PNG"), MediaLimits()).getpixel((0, 0)) == (10, 20, 30)
    assert load_image_bytes(encode(gradient().convert("P"), "PNG"), MediaLimits()).mode == "RGB"
    assert load_image(rgba, MediaLimits()).mode == "RGB"
    rgb = gradient()
    assert load_image(rgb, MediaLimits()) is rgb


def test_a_lazily_opened_pil_image_comes_back_loaded():
    buffer = io.BytesIO(PNG)
    image = load_image(Image.open(buffer), MediaLimits())
    buffer.close()
    assert image.tobytes() == gradient().tobytes()


@pytest.mark.parametrize(
    "data, words",
    [
        (PNG[: len(PNG) // 2], ["undecodable", "PNG"]),
        (encode(gradient(), "JPEG")[:100], ["undecodable", "JPEG"]),
        (b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4, ["undecodable PNG"]),
        (bytes(range(256)) * 4, ["not an image", "unrecognised"]),
        (b"Dear reader,\nthis is a text file, not a picture.\n", ["not an image", "text"]),
        (b"%PDF-1.7\n%\xe2\xe3\xcf\xd3\n1 0 obj\n<< /Type /Catalog >>\nendobj\n", ["not an image", "PDF"]),
        (b"", ["not an image", "empty"]),
    ],
    ids=["truncated-png", "truncated-jpeg", "corrupt-png", "garbage", "text", "pdf", "empty"],
)
def test_bytes_that_are_not_a_whole_image_are_refused(data, words):
    with pytest.raises(MediaError) as info:
        load_image_bytes(data, MediaLimits())
    for word in words:
        assert word in str(info.value)


def test_a_media_error_is_a_value_error_and_a_pagellm_error():
    with pytest.raises(MediaError) as info:
        load_image_bytes(b"nope", MediaLimits(), field_hint="image_url")
    assert isinstance(info.value, ValueError) and isinstance(info.value, PagellmError)
    assert info.value.field_hint == "image_url"


def test_too_many_bytes_are_refused():
    with pytest.raises(MediaError, match=f"too large: {len(PNG)} bytes, the limit is 100 bytes"):
        load_image_bytes(PNG, MediaLimits(max_image_bytes=100))


def bomb_png(width: int, height: int) -> bytes:
    """A valid 1-bit PNG of width x height black pixels: under 0.5 MB on disk, width*height pixels
    decoded (30000x30000: 900 M pixels, 2.7 GB as RGB)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    compressor = zlib.compressobj(1)
    rows = (b"\0" * (1 + (width + 7) // 8)) * 1000
    idat = b"".join([compressor.compress(rows) for _ in range(height // 1000)] + [compressor.flush()])
    header = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


@pytest.fixture
def no_decoding(monkeypatch):
    """Any pixel decoding fails the test."""

    def load(self):
        raise AssertionError("pixels were decoded")

    monkeypatch.setattr(ImageFile.ImageFile, "load", load)
    monkeypatch.setattr(Image.Image, "load", load)


def test_a_decompression_bomb_is_refused_from_its_header_without_decoding(no_decoding):
    """81 M pixels: under pillow's own guard (Image.MAX_IMAGE_PIXELS), over the limit's 40 M."""
    bomb = bomb_png(9000, 9000)
    assert len(bomb) < 100_000 and 9000 * 9000 < Image.MAX_IMAGE_PIXELS
    with pytest.raises(MediaError, match="too many pixels: 9000x9000 = 81000000, the limit is 40000000"):
        load_image_bytes(bomb, MediaLimits())


def test_pillows_own_bomb_error_becomes_a_media_error(no_decoding):
    """900 M pixels are over pillow's process-wide guard (2 x Image.MAX_IMAGE_PIXELS), which raises in
    Image.open, before the limit's check: that too is a MediaError, whatever the limit."""
    bomb = bomb_png(30000, 30000)
    assert len(bomb) < 600_000 and 30000 * 30000 > 2 * Image.MAX_IMAGE_PIXELS
    for limits in (MediaLimits(), MediaLimits(max_image_pixels=10**12)):
        with pytest.raises(MediaError, match="too many pixels"):
            load_image_bytes(bomb, limits)


def test_the_pixel_limit_is_per_call_not_process_wide():
    before = Image.MAX_IMAGE_PIXELS
    with pytest.raises(MediaError, match="too many pixels: 32x24 = 768"):
        load_image_bytes(PNG, MediaLimits(max_image_pixels=767))
    assert load_image_bytes(PNG, MediaLimits(max_image_pixels=768)).size == (32, 24)
    assert Image.MAX_IMAGE_PIXELS == before


# --- data URLs --------------------------------------------------------------------------------------------


def test_a_data_url_loads():
    assert load_image(data_url(PNG), MediaLimits()).tobytes() == gradient().tobytes()
    wrapped = data_url(PNG).replace(",", ",\n", 1)[:80] + "\n" + data_url(PNG).replace(",", ",\n", 1)[80:]
    assert load_image(wrapped, MediaLimits()).size == (32, 24)


@pytest.mark.parametrize(
    "url, words",
    [
        (data_url(b"hello", "text/plain"), ["media type 'text/plain', not an image"]),
        ("data:image/png," + PNG.hex(), ["not base64"]),
        ("data:image/png;base64,@@@not-base64@@@", ["not valid base64"]),
        ("data:image/png;base64", ["malformed"]),
        (data_url(b"just some text"), ["not an image", "text"]),
    ],
)
def test_a_bad_data_url_is_refused(url, words):
    refused(url, MediaLimits(), *words)


def test_a_large_data_url_is_refused_before_decoding(monkeypatch):
    def no_decoding(*args, **kwargs):
        raise AssertionError("base64 was decoded")

    monkeypatch.setattr(sources.base64, "b64decode", no_decoding)
    refused(data_url(PNG), MediaLimits(max_image_bytes=len(PNG) // 2), "too large")


# --- http(s) ----------------------------------------------------------------------------------------------


class Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    log: list[tuple[str, str]]  # (path, Host header) of each request received
    body_sent: int  # bytes /endless wrote before the client hung up
    endless_done: threading.Event

    def handle_error(self, request, client_address):
        pass  # a client the test hung up on (a timeout, a refused body)


class Handler(http.server.BaseHTTPRequestHandler):
    server: Server

    def log_message(self, *args):
        pass

    def send(self, status: int, body: bytes, content_type: str = "image/png", length: int | None = None):
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body) if length is None else length))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        url = urlsplit(self.path)
        query = {k: v[0] for k, v in parse_qs(url.query).items()}
        self.server.log.append((url.path, self.headers["Host"]))
        if url.path == "/ok.png":
            self.send(200, PNG)
        elif url.path == "/text":
            self.send(200, b"this is not an image\n", "text/plain")
        elif url.path == "/missing":
            self.send(404, b"not found", "text/plain")
        elif url.path == "/redirect":
            self.send_response(302)
            self.send_header("Location", query.get("to", self.path))  # no target: a loop
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif url.path == "/slow":
            time.sleep(float(query["s"]))
            self.send(200, PNG)
        elif url.path == "/drip":  # one byte every 0.1 s: no single read waits long
            self.send_response(200)
            self.end_headers()
            for byte in PNG[:50]:
                time.sleep(0.1)
                try:
                    self.wfile.write(bytes([byte]))
                    self.wfile.flush()
                except OSError:
                    return
        elif url.path == "/declared":  # Content-Length over the cap; refused before the body is read
            self.send(200, PNG, length=10**9)
        elif url.path == "/endless":  # no Content-Length: the body ends when the connection closes
            self.send_response(200)
            self.send_header("Connection", "close")
            self.end_headers()
            self.server.body_sent = 0
            try:
                for _ in range(1024):  # 64 MiB at most
                    self.wfile.write(b"\0" * 65536)
                    self.server.body_sent += 65536
            except OSError:
                pass
            finally:
                self.server.endless_done.set()
        else:
            self.send(404, b"", "text/plain")


@pytest.fixture(scope="module")
def server():
    httpd = Server(("127.0.0.1", 0), Handler)
    httpd.log, httpd.body_sent, httpd.endless_done = [], 0, threading.Event()
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture
def base(server) -> str:
    server.log.clear()
    return f"http://127.0.0.1:{server.server_address[1]}"


LOCAL = MediaLimits(allowed_domains={"127.0.0.1"}, fetch_timeout_s=5)


def test_an_http_image_loads(base):
    assert load_image(f"{base}/ok.png", LOCAL).tobytes() == gradient().tobytes()


def test_the_allow_list_is_case_insensitive(base):
    assert load_image(f"{base}/ok.png", MediaLimits(allowed_domains=["127.0.0.1."])).size == (32, 24)


def test_a_domain_off_the_allow_list_is_never_connected_to(server, base):
    port = server.server_address[1]
    refused(f"http://localhost:{port}/ok.png", LOCAL, "domain 'localhost' is not allowed")
    assert server.log == []


def test_a_redirect_to_a_domain_off_the_allow_list_is_not_followed(server, base):
    port = server.server_address[1]
    refused(f"{base}/redirect?to=http://localhost:{port}/ok.png", LOCAL, "'localhost' is not allowed")
    assert [path for path, _ in server.log] == ["/redirect"]


def test_a_redirect_to_a_file_url_is_not_followed(server, base, tmp_path):
    (tmp_path / "a.png").write_bytes(PNG)
    limits = MediaLimits(allowed_domains={"127.0.0.1"}, allowed_local_media_path=str(tmp_path))
    refused(f"{base}/redirect?to=file://{tmp_path}/a.png", limits, "is not http(s)")


def test_a_redirect_to_an_invalid_url_is_a_media_error(base):
    refused(f"{base}/redirect?to=http://%5B::1", LOCAL, "failed")


def test_a_redirect_within_the_allow_list_is_followed(server, base):
    assert load_image(f"{base}/redirect?to=/ok.png", LOCAL).size == (32, 24)
    assert [path for path, _ in server.log] == ["/redirect", "/ok.png"]


def test_a_redirect_loop_ends(server, base):
    refused(f"{base}/redirect?to=/redirect?to=/redirect", LOCAL, "more than 5 redirects")
    assert len(server.log) == 6


def test_without_an_allow_list_only_public_hosts_are_fetched(server, base):
    refused(f"{base}/ok.png", MediaLimits(), "non-public address 127.0.0.1")
    refused("http://[::1]:9/ok.png", MediaLimits(), "non-public address ::1")
    assert server.log == []


def fake_dns(monkeypatch, infos: list):
    """images.test resolves to `infos` (getaddrinfo's answer); other names as before."""
    real = sources.socket.getaddrinfo
    fake = lambda host, *a, **k: infos if host == "images.test" else real(host, *a, **k)  # noqa: E731
    monkeypatch.setattr(sources.socket, "getaddrinfo", fake)


def test_a_public_host_is_fetched_from_the_address_that_was_checked(server, base, monkeypatch):
    """The request goes to the resolved address (so a second lookup cannot swap in a private one) and
    still names the host. Here images.test 'resolves' to the loopback server, taken as public."""
    port = server.server_address[1]
    fake_dns(monkeypatch, [(0, 0, 0, "", ("127.0.0.1", port))])
    monkeypatch.setattr(sources, "_is_public", lambda address: True)
    assert load_image(f"http://images.test:{port}/ok.png", MediaLimits()).size == (32, 24)
    assert server.log == [("/ok.png", f"images.test:{port}")]


def test_a_host_with_any_private_address_is_refused(server, base, monkeypatch):
    infos = [(0, 0, 0, "", ("8.8.8.8", 80)), (0, 0, 0, "", ("10.1.2.3", 80))]
    fake_dns(monkeypatch, infos)
    refused("http://images.test/ok.png", MediaLimits(), "non-public address 10.1.2.3")


def test_a_failed_fetch_names_the_status(base):
    refused(f"{base}/missing", LOCAL, "failed with HTTP status 404")


def test_a_fetched_text_file_is_refused(base):
    refused(f"{base}/text", LOCAL, "not an image", "text")


def test_a_body_over_the_cap_is_refused_before_it_is_all_read(server, base):
    server.endless_done.clear()
    refused(
        f"{base}/endless", MediaLimits(allowed_domains={"127.0.0.1"}, max_image_bytes=100_000), "too large"
    )
    assert server.endless_done.wait(10)
    assert server.body_sent < 32 * 1024 * 1024  # the client hung up: the server could not send its 64 MiB


def test_a_declared_length_over_the_cap_is_refused(base):
    refused(f"{base}/declared", LOCAL, "too large: 1000000000 bytes")


def test_a_slow_server_times_out(base):
    start = time.monotonic()
    refused(f"{base}/slow?s=3", MediaLimits(allowed_domains={"127.0.0.1"}, fetch_timeout_s=0.3), "timed out")
    assert time.monotonic() - start < 2


def test_a_body_that_trickles_in_times_out_as_a_whole(base):
    """Each byte comes within the timeout; the fetch as a whole does not."""
    start = time.monotonic()
    refused(f"{base}/drip", MediaLimits(allowed_domains={"127.0.0.1"}, fetch_timeout_s=0.5), "timed out")
    assert time.monotonic() - start < 2


def test_the_async_loader_leaves_the_event_loop_free(base):
    async def main():
        ticks = 0

        async def tick():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.02)
                ticks += 1

        ticker = asyncio.create_task(tick())
        image = await load_image_async(f"{base}/slow?s=0.5", LOCAL)
        ticker.cancel()
        return image, ticks

    image, ticks = asyncio.run(main())
    assert image.size == (32, 24) and ticks >= 10


# --- local files ------------------------------------------------------------------------------------------


@pytest.fixture
def folders(tmp_path):
    """allowed/ with an image, and outside it a secret file that is a valid PNG."""
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    (allowed / "ok.png").write_bytes(PNG)
    (tmp_path / "secret.png").write_bytes(encode(Image.new("RGB", (3, 3), (1, 2, 3)), "PNG"))
    os.symlink(tmp_path / "secret.png", allowed / "link.png")
    os.symlink(allowed / "ok.png", allowed / "inside-link.png")
    return allowed, MediaLimits(allowed_local_media_path=str(allowed))


def test_a_local_file_inside_the_folder_loads(folders):
    allowed, limits = folders
    for source in (
        str(allowed / "ok.png"),
        f"file://{allowed}/ok.png",
        "ok.png",
        str(allowed / "inside-link.png"),
    ):
        assert load_image(source, limits).size == (32, 24), source


def test_local_files_are_refused_without_a_folder(folders):
    allowed, _ = folders
    refused(str(allowed / "ok.png"), MediaLimits(), "local files are not allowed")
    refused(f"file://{allowed}/ok.png", MediaLimits(), "local files are not allowed")


def test_a_path_outside_the_folder_is_refused_and_never_opened(folders, monkeypatch):
    allowed, limits = folders
    opened = []
    monkeypatch.setattr(sources, "open", lambda *a, **k: opened.append(a) or open(*a, **k), raising=False)
    outside = [
        str(allowed.parent / "secret.png"),
        f"file://{allowed.parent}/secret.png",
        f"{allowed}/../secret.png",
        f"file://{allowed}/../secret.png",
        "../secret.png",
        str(allowed / "link.png"),
        f"file://{allowed}/link.png",
        "/etc/passwd",
    ]
    for source in outside:
        refused(source, limits, "outside allowed_local_media_path")
    assert opened == []
    assert load_image(str(allowed / "ok.png"), limits).size == (32, 24)
    assert len(opened) == 1  # the spy does see a read


def test_a_file_url_naming_another_host_is_refused(folders):
    allowed, limits = folders
    refused(f"file://otherhost{allowed}/ok.png", limits, "names host 'otherhost'")


def test_a_local_text_file_is_refused(folders):
    allowed, limits = folders
    (allowed / "notes.txt").write_text("meeting at noon\n")
    refused(str(allowed / "notes.txt"), limits, "not an image", "text")
    refused(str(allowed / "absent.png"), limits, "does not exist")
    refused(str(allowed), limits, "not a regular file")


def test_a_local_file_over_the_cap_is_refused(folders):
    allowed, _ = folders
    limits = MediaLimits(allowed_local_media_path=str(allowed), max_image_bytes=100)
    refused(str(allowed / "ok.png"), limits, f"too large: {len(PNG)} bytes")


def test_an_unknown_scheme_is_refused():
    refused("ftp://127.0.0.1/ok.png", MediaLimits(), "unsupported URL scheme 'ftp'")


# --- limits and content hash ------------------------------------------------------------------------------


def test_limits_that_cannot_work_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="is not a folder"):
        MediaLimits(allowed_local_media_path=str(tmp_path / "absent"))
    with pytest.raises(ConfigError, match="not one string"):
        MediaLimits(allowed_domains="example.com")
    with pytest.raises(ConfigError, match="max_image_bytes must be > 0"):
        MediaLimits(max_image_bytes=0)


def test_the_content_hash_follows_the_pixels():
    first, second = load_image_bytes(PNG, MediaLimits()), load_image(data_url(PNG), MediaLimits())
    assert first is not second and content_hash(first) == content_hash(second)
    lossless = load_image_bytes(encode(gradient(), "WEBP", lossless=True), MediaLimits())
    assert content_hash(lossless) == content_hash(first)
    changed = first.copy()
    changed.putpixel((31, 23), (0, 0, 0) if changed.getpixel((31, 23)) != (0, 0, 0) else (1, 0, 0))
    assert content_hash(changed) != content_hash(first)
    pixels = first.tobytes()
    assert content_hash(Image.frombytes("RGB", (24, 32), pixels)) != content_hash(first)
    grey = Image.frombytes("L", (96, 24), pixels)
    assert content_hash(grey) != content_hash(first)
    palette = first.convert("P")
    other_palette = palette.copy()
    other_palette.putpalette([255 - v for v in palette.getpalette()])
    assert content_hash(other_palette) != content_hash(palette)
