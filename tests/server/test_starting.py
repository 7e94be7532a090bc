"""`pagellm serve` listens from the start: while its engine loads, every route answers 503 with the reason
(`code: "starting"`) and Retry-After, so a health check sees a server that is starting, not a refused
connection; then the app answers. A start that fails ends the server with the reason and a non-zero exit."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import httpx
from click.testing import CliRunner
from server_harness import free_port

from pagellm.cli.main import cli
from pagellm.core.errors import ConfigError
from pagellm.engine.async_llm import AsyncLLM
from pagellm.server.starting import StartingGate


def get(app, *paths: str) -> list[httpx.Response]:
    async def run() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as http:
            return [await http.get(path) for path in paths]

    return asyncio.run(run())


def test_the_gate_answers_503_starting_on_every_route_until_it_opens():
    gate = StartingGate("tiny")
    health, models, messages = get(gate, "/health", "/v1/models", "/v1/messages")
    for response in (health, models):
        assert response.status_code == 503 and response.headers["retry-after"] == "5"
        error = response.json()["error"]
        assert error["code"] == "starting" and "loading tiny" in error["message"]
    assert messages.status_code == 503 and messages.json()["type"] == "error"  # Anthropic's body there

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"app"})

    gate.open(app)
    (health,) = get(gate, "/health")
    assert health.status_code == 200 and health.text == "app"


def serve(*args: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [sys.executable, "-c", "from pagellm.cli.main import main; main()", "serve", *args]
    command += ["--port", str(port), "--dtype", "float32", "--num-kv-blocks", "64", "--max-model-len", "64"]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True), (
        f"http://127.0.0.1:{port}"
    )


def poll_health(process: subprocess.Popen, url: str, timeout_s: float = 180) -> list[int]:
    """The /health statuses seen until it answers 200 or the process exits."""
    seen: list[int] = []
    deadline = time.monotonic() + timeout_s
    while process.poll() is None and time.monotonic() < deadline:
        try:
            response = httpx.get(f"{url}/health", timeout=2)
        except httpx.HTTPError:
            time.sleep(0.05)
            continue
        seen.append(response.status_code)
        if response.status_code == 200:
            break
        assert response.json()["error"]["code"] == "starting"
        time.sleep(0.05)
    return seen


def test_a_server_answers_starting_while_its_engine_loads_then_serves(tiny_model_dir):
    process, url = serve(str(tiny_model_dir))
    try:
        seen = poll_health(process, url)
        assert seen[0] == 503 and seen[-1] == 200, seen
        body = {"prompt": "Hello", "max_tokens": 3, "temperature": 0}
        completion = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert completion.status_code == 200 and completion.json()["usage"]["completion_tokens"] == 3
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_a_server_whose_engine_fails_to_start_exits_with_the_reason(tiny_model_dir, monkeypatch):
    def fail(cls, config, launched=None):
        launched.discard()  # as AsyncLLM does with a launch it did not adopt
        raise ConfigError("the checkpoint's architecture NoSuchModelForCausalLM is not supported")

    monkeypatch.setattr(AsyncLLM, "from_config", classmethod(fail))
    result = CliRunner().invoke(cli, ["serve", str(tiny_model_dir), "--port", str(free_port())])
    assert result.exit_code == 1 and "NoSuchModelForCausalLM is not supported" in result.output
