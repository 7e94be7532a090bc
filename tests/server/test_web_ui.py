"""The chat page at `/` over plain HTTP (the browser test is test_web_ui_browser.py): the page and its assets
come with a Content-Security-Policy that allows no inline script, the page has none, it loads without the
API key while every API path still needs it, the API works beside it, `--no-web-ui` (and `build_app`'s
default) leaves `/` a 404, and the wheel's package data holds every file of the page."""

from __future__ import annotations

import json
import re
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest
from click.testing import CliRunner
from openai_asgi import call_app

from pagellm.cli import serve_cmd
from pagellm.cli.main import cli
from pagellm.server import web_ui
from pagellm.server.app import build_app

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).parents[2]
KEY = "sk-web-ui-test"


class _PageParser(HTMLParser):
    """The page's <script>s (their src and whether they have a body), the files it links, and any
    inline event handler (on...=) or style attribute, which the CSP would refuse."""

    def __init__(self):
        super().__init__()
        self.scripts: list[tuple[str | None, str]] = []
        self.links: list[str] = []
        self.inline: list[str] = []
        self._in_script = False

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.inline += [f"{tag}[{name}]" for name in attrs if name.startswith("on") or name == "style"]
        if tag == "script":
            self.scripts.append((attrs.get("src"), ""))
            self._in_script = True
        if tag == "link" and attrs.get("href"):
            self.links.append(attrs["href"])

    def handle_endtag(self, tag):
        self._in_script = self._in_script and tag != "script"

    def handle_data(self, data):
        if self._in_script:
            src, body = self.scripts[-1]
            self.scripts[-1] = (src, body + data)


def parse_page(html: str) -> _PageParser:
    parser = _PageParser()
    parser.feed(html)
    return parser


@pytest.fixture(scope="module")
def app(llm):
    return build_app(llm, ["tiny"], log_requests=False, web_ui=True)


@pytest.fixture(scope="module")
def keyed_app(llm):
    return build_app(llm, ["tiny"], log_requests=False, web_ui=True, api_keys=[KEY])


def assert_csp(response) -> None:
    policy = dict(
        part.strip().split(" ", 1) for part in response.headers["content-security-policy"].split(";")
    )
    assert policy["default-src"] == "'self'"
    assert policy["script-src"] == "'self'"  # no 'unsafe-inline', no 'unsafe-eval', no other host
    assert policy["connect-src"] == "'self'"
    assert policy["frame-ancestors"] == "'none'"
    assert response.headers["x-content-type-options"] == "nosniff"


def test_the_page_and_its_assets_come_with_the_csp_and_no_inline_script(app):
    async def work(client, http):
        page = await http.get("/")
        assert page.status_code == 200
        assert page.headers["content-type"].startswith("text/html")
        assert_csp(page)
        parsed = parse_page(page.text)
        assert parsed.scripts and all(src and not body.strip() for src, body in parsed.scripts)
        assert parsed.inline == []
        assets = [src for src, _ in parsed.scripts] + parsed.links
        assert not [a for a in assets if not a.startswith(web_ui.ASSET_PREFIX)]  # nothing from elsewhere
        types = {}
        for asset in assets:
            response = await http.get(asset)
            assert response.status_code == 200, asset
            assert_csp(response)
            types[asset.rsplit(".", 1)[1]] = response.headers["content-type"]
        assert types["js"].startswith("text/javascript") and types["css"].startswith("text/css")
        again = await http.get("/", headers={"if-none-match": page.headers["etag"]})
        assert again.status_code == 304
        missing = await http.get(web_ui.ASSET_PREFIX + "nope.js")
        assert missing.status_code == 404

    call_app(app, work)


def test_the_script_fetches_nothing_from_other_hosts():
    for path in web_ui.STATIC_DIR.iterdir():
        text = path.read_text().replace('xmlns="http://www.w3.org/2000/svg"', "")  # a name, not fetched
        assert not re.findall(r"https?://", text), path.name
        assert "innerHTML" not in text and "eval(" not in text, path.name


def test_the_page_loads_without_the_api_key_and_the_api_still_needs_it(keyed_app):
    async def work(client, http):
        assert (await http.get("/")).status_code == 200
        assert (await http.get("/web-ui/app.js")).status_code == 200
        assert (await http.get("/v1/models")).status_code == 401
        assert (await http.post("/", json={})).status_code == 401  # only the page's GETs are open
        keyed = {"Authorization": f"Bearer {KEY}"}
        assert (await http.get("/v1/models", headers=keyed)).json()["data"][0]["id"] == "tiny"

    call_app(keyed_app, work)


def test_the_api_answers_beside_the_page(app):
    """What the page itself sends: a streamed chat completion, read as server-sent events."""

    async def work(client, http):
        assert (await http.get("/health")).status_code == 200
        body = {
            "model": "tiny",
            "messages": [{"role": "user", "content": "Hello"}],
            "stream": True,
            "stream_options": {"include_usage": True},
            "max_tokens": 5,
            "temperature": 0.7,
            "top_p": 1,
        }
        events = []
        async with http.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    events.append(line[len("data: ") :])
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert chunks[-1]["usage"]["completion_tokens"] == 5
        paths = (await http.get("/openapi.json")).json()["paths"]
        assert "/" not in paths and "/v1/chat/completions" in paths

    call_app(app, work)


def test_without_the_web_ui_slash_is_404(llm):
    async def work(client, http):
        assert (await http.get("/")).status_code == 404
        assert (await http.get("/web-ui/app.js")).status_code == 404
        assert (await http.get("/v1/models")).status_code == 200

    call_app(build_app(llm, ["tiny"], log_requests=False), work)


@pytest.mark.parametrize("flags, served", [((), True), (("--no-web-ui",), False)])
def test_serve_passes_no_web_ui_to_the_app(tiny_model_dir, monkeypatch, flags, served):
    seen = {}
    monkeypatch.setattr(
        serve_cmd, "_serve", lambda config, launched, host, port, names, options: seen.update(options)
    )
    monkeypatch.setattr(serve_cmd, "EngineLaunch", lambda: None)
    result = CliRunner().invoke(cli, ["serve", str(tiny_model_dir), *flags])
    assert result.exit_code == 0, result.output
    assert seen["web_ui"] is served


def test_the_wheel_ships_every_file_of_the_page():
    """pyproject's package data for pagellm.server must name the page's files, or an installed server has
    none (tests/test_packaging.py builds the wheel; this checks the globs, in milliseconds)."""
    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    package = ROOT / "pagellm" / "server"
    shipped = {p for pattern in package_data["pagellm.server"] for p in package.glob(pattern)}
    files = set(web_ui.STATIC_DIR.iterdir())
    assert files and files <= shipped
    assert set(web_ui.load_files()) >= {"/", "/web-ui/app.js", "/web-ui/style.css", "/web-ui/favicon.svg"}
