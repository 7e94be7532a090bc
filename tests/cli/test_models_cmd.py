"""`pagellm pull / list / ps / rm` against a Hugging Face cache in tmp_path, filled by huggingface_hub's own
download code from a tiny local Hub (an HTTP server speaking the Hub's API), with no internet."""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest
from click.testing import CliRunner

from pagellm.cli import hub_cache
from pagellm.cli.main import cli
from pagellm.models import hub

COMMIT = "c0ffee" + "0" * 34
REPOS = {
    "org/tiny-GGUF": {
        "tiny-Q4_K_M.gguf": b"q4" * 700,
        "tiny-Q8_0.gguf": b"q8" * 1500,
        "README.md": b"# tiny",
    },
    "org/tiny": {
        "config.json": b'{"model_type": "llama"}',
        "tokenizer.json": b"{}",
        "model.safetensors": b"s" * 3000,
        "training_args.bin": b"b" * 5000,  # not a weight file pagellm reads: not pulled
        "README.md": b"# tiny",
    },
}


class FakeHub:
    """The Hub endpoints huggingface_hub's model_info, snapshot_download and hf_hub_download call: repository
    info, the file tree, and files by resolve URL (HEAD with commit and ETag headers, GET with the bytes)."""

    def __init__(self, repos: dict[str, dict[str, bytes]]):
        self.repos = repos
        self.requests: list[tuple[str, str]] = []
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def _answer(self, method: str, path: str) -> tuple[int, bytes, dict[str, str]]:
        self.requests.append((method, path))
        as_json = {"Content-Type": "application/json"}
        if m := re.match(r"^/api/models/([^/]+/[^/]+)(?:/revision/([^/]+))?$", path):
            if m[1] in self.repos:
                siblings = [{"rfilename": f, "size": len(b)} for f, b in self.repos[m[1]].items()]
                info = {"id": m[1], "modelId": m[1], "sha": COMMIT, "private": False, "siblings": siblings}
                return 200, json.dumps(info).encode(), as_json
        if (m := re.match(r"^/api/models/([^/]+/[^/]+)/tree/", path)) and m[1] in self.repos:
            tree = [
                {"type": "file", "path": f, "size": len(b), "oid": hashlib.sha1(b).hexdigest()}
                for f, b in self.repos[m[1]].items()
            ]
            return 200, json.dumps(tree).encode(), as_json
        if m := re.match(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$", path):
            data = self.repos.get(m[1], {}).get(m[3])
            if data is not None:
                return 200, data, {"X-Repo-Commit": COMMIT, "ETag": f'"{hashlib.sha1(data).hexdigest()}"'}
        return 404, b'{"error": "Repository not found"}', {"X-Error-Code": "RepoNotFound"}

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        hub_ = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_HEAD(self) -> None:
                self._serve(body=False)

            def do_GET(self) -> None:
                self._serve(body=True)

            def _serve(self, body: bool) -> None:
                code, data, headers = hub_._answer(self.command, unquote(urlparse(self.path).path))
                self.send_response(code)
                for key, value in headers.items():
                    self.send_header(key, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if body:
                    self.wfile.write(data)

        return Handler

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """An empty Hugging Face cache under tmp_path, online mode (the suite runs with HF_HUB_OFFLINE=1)."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "PAGELLM_PROGRESS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "0")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # read at import, from the suite's 1
    monkeypatch.setenv("HF_HUB_ETAG_TIMEOUT", "5")
    return tmp_path / "hf" / "hub"


@pytest.fixture
def fake_hub(cache, monkeypatch):
    server = FakeHub(REPOS)
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    yield server
    server.close()


def run(*args: str, input: str | None = None):
    return CliRunner().invoke(cli, list(args), input=input, catch_exceptions=False)


def snapshot(cache: Path, repo_id: str) -> Path:
    return cache / f"models--{repo_id.replace('/', '--')}" / "snapshots" / COMMIT


def blobs(cache: Path, repo_id: str) -> list[Path]:
    return sorted((cache / f"models--{repo_id.replace('/', '--')}" / "blobs").iterdir())


# -- pull ------------------------------------------------------------------------------------------------


def test_pull_quant_downloads_only_that_gguf_file_and_serve_finds_it_offline(fake_hub, cache, monkeypatch):
    result = run("pull", "org/tiny-GGUF:q4_k_m")
    assert result.exit_code == 0, result.output
    folder = snapshot(cache, "org/tiny-GGUF")
    assert sorted(os.listdir(folder)) == ["tiny-Q4_K_M.gguf"]
    assert (folder / "tiny-Q4_K_M.gguf").read_bytes() == REPOS["org/tiny-GGUF"]["tiny-Q4_K_M.gguf"]
    assert str(folder / "tiny-Q4_K_M.gguf") in result.output
    assert not any("Q8_0" in path for _, path in fake_hub.requests)
    # what `serve org/tiny-GGUF:Q4_K_M` resolves, with the network gone
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert hub.gguf_path("org/tiny-GGUF", "Q4_K_M") == str(folder / "tiny-Q4_K_M.gguf")


def test_pull_model_fetches_config_tokenizer_and_one_weight_format(fake_hub, cache, monkeypatch):
    result = run("pull", "org/tiny")
    assert result.exit_code == 0, result.output
    folder = snapshot(cache, "org/tiny")
    assert sorted(os.listdir(folder)) == ["config.json", "model.safetensors", "tokenizer.json"]
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert hub.model_snapshot("org/tiny") == str(folder)


def test_pull_unknown_quant_lists_the_available_ones(fake_hub, cache):
    result = run("pull", "org/tiny-GGUF:Q3_K_S")
    assert result.exit_code == 1
    assert "Q3_K_S" in result.output and "Q4_K_M, Q8_0" in result.output
    assert not cache.joinpath("models--org--tiny-GGUF", "snapshots").exists()


def test_pull_gguf_repository_without_quant_asks_for_one(fake_hub, cache):
    result = run("pull", "org/tiny-GGUF")
    assert result.exit_code == 1
    assert "GGUF repository" in result.output and "org/tiny-GGUF:Q4_K_M" in result.output


def test_pull_unknown_repository_says_so(fake_hub, cache):
    result = run("pull", "org/missing")
    assert result.exit_code == 1
    assert "no such repository" in result.output


def test_pull_offline_fails_at_once_with_the_reason(cache, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_ENDPOINT", "http://192.0.2.1")  # TEST-NET: would hang if it were asked
    started = time.monotonic()
    result = run("pull", "org/tiny-GGUF:Q4_K_M")
    assert time.monotonic() - started < 3
    assert result.exit_code == 1
    assert "HF_HUB_OFFLINE" in result.output and "nothing is downloaded" in result.output


def test_pull_offline_of_a_cached_model_succeeds_without_the_hub(fake_hub, cache, monkeypatch):
    assert run("pull", "org/tiny-GGUF:Q8_0").exit_code == 0
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    fake_hub.requests.clear()
    result = run("pull", "org/tiny-GGUF:Q8_0")
    assert result.exit_code == 0, result.output
    assert "already in the cache" in result.output and fake_hub.requests == []
    other = run("pull", "org/tiny-GGUF:Q4_K_M")  # cached repository, but not this quant
    assert other.exit_code == 1 and "HF_HUB_OFFLINE" in other.output and "Q4_K_M" in other.output
    assert fake_hub.requests == []


def test_pull_with_the_hub_unreachable_fails_fast(cache, monkeypatch):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    started = time.monotonic()
    result = run("pull", "org/tiny")
    assert time.monotonic() - started < 5
    assert result.exit_code == 1
    assert "could not be reached" in result.output


# -- list ------------------------------------------------------------------------------------------------


def test_list_shows_size_format_and_last_use(fake_hub, cache):
    assert "no models in the Hugging Face cache" in run("list").output
    assert run("pull", "org/tiny-GGUF:Q4_K_M").exit_code == 0
    assert run("pull", "org/tiny-GGUF:Q8_0").exit_code == 0
    assert run("pull", "org/tiny").exit_code == 0
    lines = run("list").output.splitlines()
    assert lines[0].split() == ["NAME", "SIZE", "FORMAT", "LAST", "USED"]
    rows = {line.split()[0]: line for line in lines[1:]}
    assert set(rows) == {"org/tiny", "org/tiny-GGUF"}
    assert re.search(r"org/tiny-GGUF\s+4\.4 KB\s+GGUF Q4_K_M, Q8_0\s+just now", rows["org/tiny-GGUF"])
    assert re.search(r"org/tiny\s+3\.0 KB\s+safetensors\s+just now", rows["org/tiny"])


@pytest.mark.parametrize(
    "name, quant",
    [
        ("Qwen3-0.6B-Q4_K_M.gguf", "Q4_K_M"),
        ("llama.Q8_0.gguf", "Q8_0"),
        ("model_iq2_xxs.gguf", "IQ2_XXS"),
        ("gpt-oss-20b-MXFP4.gguf", "MXFP4"),
        ("sub/model-BF16-00001-of-00002.gguf", "BF16"),
        ("model.gguf", None),
    ],
)
def test_quant_of_reads_the_tag_llama_cpp_names_files_with(name, quant):
    assert hub_cache.quant_of(name) == quant


def test_model_format():
    assert hub_cache.model_format(["a.gguf", "m-Q4_0.gguf", "m-F16.gguf"]) == "GGUF F16, Q4_0"
    assert hub_cache.model_format(["pytorch_model.bin", "config.json"]) == "pytorch .bin"
    assert hub_cache.model_format(["config.json"]) == "other"


# -- rm --------------------------------------------------------------------------------------------------


def test_rm_quant_removes_its_file_and_blob_only(fake_hub, cache):
    assert run("pull", "org/tiny-GGUF:Q4_K_M").exit_code == 0
    assert run("pull", "org/tiny-GGUF:Q8_0").exit_code == 0
    assert len(blobs(cache, "org/tiny-GGUF")) == 2
    result = run("rm", "org/tiny-GGUF:Q4_K_M", "--yes")
    assert result.exit_code == 0, result.output
    assert "1.4 KB freed" in result.output
    assert sorted(os.listdir(snapshot(cache, "org/tiny-GGUF"))) == ["tiny-Q8_0.gguf"]
    assert [b.stat().st_size for b in blobs(cache, "org/tiny-GGUF")] == [3000]
    assert "GGUF Q8_0" in run("list").output
    # the last quant: the repository goes whole
    assert run("rm", "org/tiny-GGUF:Q8_0", "--yes").exit_code == 0
    assert not (cache / "models--org--tiny-GGUF").exists()


def test_rm_repository_and_its_confirmation(fake_hub, cache):
    assert run("pull", "org/tiny").exit_code == 0
    refused = run("rm", "org/tiny")  # CliRunner's stdin is no terminal: no one to ask
    assert refused.exit_code == 2 and "--yes" in refused.output
    assert (cache / "models--org--tiny").exists()
    result = run("rm", "org/tiny", "-y")
    assert result.exit_code == 0, result.output
    assert not (cache / "models--org--tiny").exists()
    assert "no models" in run("list").output


def test_rm_of_what_is_not_cached_says_so(fake_hub, cache):
    result = run("rm", "org/tiny", "--yes")
    assert result.exit_code == 1 and "not in the Hugging Face cache" in result.output
    assert run("pull", "org/tiny-GGUF:Q8_0").exit_code == 0
    result = run("rm", "org/tiny-GGUF:Q4_K_M", "--yes")
    assert result.exit_code == 1 and "cached quants: Q8_0" in result.output


# -- ps --------------------------------------------------------------------------------------------------


class FakeServer:
    """A server answering /v1/models (and /api/ps where given) the way pagellm's does."""

    def __init__(self, routes: dict[str, dict], key: str | None = None):
        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                if key and self.headers.get("Authorization") != f"Bearer {key}":
                    code, data = 401, b'{"error": "unauthorized"}'
                elif self.path in routes:
                    code, data = 200, json.dumps(routes[self.path]).encode()
                else:
                    code, data = 404, b'{"detail": "Not Found"}'
                self.send_response(code)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_ps_shows_state_size_and_context():
    server = FakeServer(
        {
            "/v1/models": {
                "object": "list",
                "data": [
                    {"id": "qwen", "object": "model", "max_model_len": 4096, "state": "loaded"},
                    {"id": "llama", "object": "model", "max_model_len": 8192, "state": "unloaded"},
                ],
            },
            "/api/ps": {"models": [{"name": "qwen", "size": 1_500_000_000, "context_length": 4096}]},
        }
    )
    try:
        result = run("ps", "--url", server.url)
    finally:
        server.close()
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].split() == ["NAME", "STATE", "SIZE", "CONTEXT"]
    assert lines[1].split() == ["qwen", "loaded", "1.5", "GB", "4096"]
    assert lines[2].split() == ["llama", "unloaded", "-", "8192"]


def test_ps_single_model_server_without_state_or_api_ps_and_with_a_key(monkeypatch):
    server = FakeServer({"/v1/models": {"data": [{"id": "SmolLM2", "max_model_len": 2048}]}}, key="k1")
    try:
        refused = run("ps", "--url", server.url)
        monkeypatch.setenv("PAGELLM_API_KEY", "k1 k2")
        result = run("ps", "--url", server.url)
    finally:
        server.close()
    assert refused.exit_code == 1 and "401" in refused.output and "--api-key" in refused.output
    assert result.exit_code == 0, result.output
    assert result.output.splitlines()[1].split() == ["SmolLM2", "loaded", "-", "2048"]


def test_ps_without_a_server_says_so():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result = run("ps", "--url", f"http://127.0.0.1:{port}")
    assert result.exit_code == 1 and "no pagellm server answers" in result.output


def test_ps_against_a_running_pagellm_server(tmp_path):
    """The real app's /v1/models and /api/ps, served by uvicorn on a thread over a tiny random checkpoint."""
    import uvicorn
    from tiny import make_tiny_checkpoint

    from pagellm import AsyncLLM
    from pagellm.server.app import build_app

    llm = AsyncLLM(
        str(make_tiny_checkpoint("llama", tmp_path)),
        dtype="float32",
        num_kv_blocks=16,
        max_model_len=128,
        engine_process=False,
    )
    server = uvicorn.Server(
        uvicorn.Config(
            build_app(llm, ["tiny"], log_requests=False), host="127.0.0.1", port=0, log_level="error"
        )
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        port = server.servers[0].sockets[0].getsockname()[1]
        result = run("ps", "--url", f"http://127.0.0.1:{port}/")
    finally:
        server.should_exit = True
        thread.join(10)
        llm.shutdown()
    assert result.exit_code == 0, result.output
    name, state, *size, context = result.output.splitlines()[1].split()
    assert (name, state, context) == ("tiny", "loaded", "128")
    assert size[-1] in ("KB", "MB")  # the checkpoint's weights, from /api/ps
