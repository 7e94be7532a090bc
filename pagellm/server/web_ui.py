"""The chat page `pagellm serve` shows at `/` (`--no-web-ui` leaves it out): three static files in
web_ui_static/ (plain HTML, JavaScript and CSS, no build step, nothing fetched from elsewhere) that talk to the
server's own `/v1/models` and `/v1/chat/completions`, as any other client would.

The files are served by an ASGI middleware in front of the app's other middleware rather than as routes, so
that the page loads without an API key: a browser cannot add `Authorization` to a page load, and the files hold
nothing secret. The page asks for the key when the API answers 401, and sends it on its API calls; every API
path stays behind the key. Nothing of the page is in the OpenAPI schema either.

Every file goes out with a Content-Security-Policy that allows scripts, styles and connections from the
server itself only (no inline scripts, no other origins): the page shows model output and the user's
pasted text, and whatever that holds can then never run as script or leak to another host.
"""

from __future__ import annotations

import zlib
from pathlib import Path

from fastapi import FastAPI
from starlette.datastructures import Headers
from starlette.responses import PlainTextResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

STATIC_DIR = Path(__file__).with_name("web_ui_static")
ASSET_PREFIX = "/web-ui/"
PAGE = "index.html"

# images: the user's attachments are shown from data: URLs (and blob: ones while picked)
CONTENT_SECURITY_POLICY = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; "
    "connect-src 'self'; font-src 'self'; object-src 'none'; base-uri 'none'; form-action 'none'; "
    "frame-ancestors 'none'"
)
SECURITY_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    # revalidate on every load: an upgraded server must not run yesterday's app.js against today's API
    "Cache-Control": "no-cache",
}
MEDIA_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
}


def load_files(directory: Path = STATIC_DIR) -> dict[str, tuple[bytes, str]]:
    """URL path -> (body, media type) for the page (at `/`) and each asset (under /web-ui/). Read once, at
    start-up: the files are a few tens of KiB, and a missing one fails the server's start, not a page load."""
    files: dict[str, tuple[bytes, str]] = {}
    for path in sorted(directory.iterdir()):
        if path.suffix not in MEDIA_TYPES:
            continue
        body, media_type = path.read_bytes(), MEDIA_TYPES[path.suffix]
        files[ASSET_PREFIX + path.name] = (body, media_type)
        if path.name == PAGE:
            files["/"] = (body, media_type)
    if "/" not in files:
        raise FileNotFoundError(f"the web UI's {PAGE} is missing from {directory}")
    return files


class WebUIMiddleware:
    """Answers GET and HEAD of the page and its assets itself, ahead of the API-key and body-size checks;
    anything else (other paths, other methods) goes on to the app unchanged."""

    def __init__(self, app: ASGIApp, files: dict[str, tuple[bytes, str]] | None = None):
        self.app = app
        self.files = load_files() if files is None else files

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or (path != "/" and not path.startswith(ASSET_PREFIX)):
            await self.app(scope, receive, send)
            return
        if scope["method"] not in ("GET", "HEAD"):
            await self.app(scope, receive, send)
            return
        found = self.files.get(path)
        if found is None:
            response: Response = PlainTextResponse("Not Found", status_code=404, headers=SECURITY_HEADERS)
        else:
            body, media_type = found
            etag = f'"{zlib.crc32(body):08x}"'
            if Headers(scope=scope).get("if-none-match") == etag:
                response = Response(status_code=304, headers={**SECURITY_HEADERS, "ETag": etag})
            else:
                headers = {**SECURITY_HEADERS, "ETag": etag}
                response = Response(body, media_type=media_type, headers=headers)
        await response(scope, receive, send)


def install_web_ui(app: FastAPI) -> None:
    """Serve the chat page on `app`. Call it after the app's other `add_middleware` calls: the last added
    runs first, so the page is answered before the API-key check."""
    app.add_middleware(WebUIMiddleware)
