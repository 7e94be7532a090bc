"""Every curl example in docs/serving.md and README.md runs as written against a real `pagellm serve`.

The server serves the tiny test model under the embedded default's name, so the examples' `"model"` field
matches; only `localhost:8000` is pointed at the test server's free port.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from server_harness import ServerProcess

DOC = Path(__file__).parents[2] / "docs" / "serving.md"
README = Path(__file__).parents[2] / "README.md"


def curl_examples(*docs: Path) -> list[str]:
    """The shell blocks of the docs that start with curl: one command each (continuation lines joined)."""
    commands = []
    text = "".join(doc.read_text() for doc in docs or (DOC, README))
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        if block.startswith("curl"):
            commands += [c for c in re.split(r"\n(?=curl )", block.strip()) if c]
    return commands


SERVE_ARGS = ["--served-model-name", "SmolLM2-135M-Instruct", "--dtype", "float32", "--num-kv-blocks", "256"]


def embeddings(command: str) -> bool:
    """The examples of /v1/embeddings run against a `--runner pooling` server."""
    return "/v1/embeddings" in command


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    proc = ServerProcess(tiny_model_dir, SERVE_ARGS, tmp_path_factory.mktemp("log") / "serve.log")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def pooling_server(tiny_model_dir, tmp_path_factory):
    args = [*SERVE_ARGS, "--runner", "pooling"]
    proc = ServerProcess(tiny_model_dir, args, tmp_path_factory.mktemp("log") / "serve-pooling.log")
    yield proc
    proc.stop()


def test_the_doc_has_curl_examples_for_every_endpoint():
    text = " ".join(curl_examples(DOC))
    paths = (
        "/v1/models",
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/embeddings",
        "/tokenize",
        "/detokenize",
    )
    for path in (*paths, "/v1/messages", "/v1/messages/count_tokens"):
        assert f"localhost:8000{path}" in text
    for path in ("/health", "/version", "/metrics"):
        assert f"localhost:8000{path}" in text


@pytest.mark.skipif(shutil.which("curl") is None, reason="needs curl")
def test_curl_examples_run_as_written(server):
    run_examples(server, [c for c in curl_examples() if not embeddings(c)])


@pytest.mark.skipif(shutil.which("curl") is None, reason="needs curl")
@pytest.mark.slow
def test_embedding_curl_examples_run_against_a_pooling_server(pooling_server):
    commands = [c for c in curl_examples() if embeddings(c)]
    assert commands
    run_examples(pooling_server, commands)


def run_examples(server, commands: list[str]) -> None:
    port = server.url.rsplit(":", 1)[1]
    for command in commands:
        run = subprocess.run(
            ["bash", "-o", "pipefail", "-c", command.replace("localhost:8000", f"127.0.0.1:{port}")],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert run.returncode == 0, f"{command}\n{run.stderr}"
        out = run.stdout
        assert out.strip() and '"error"' not in out, f"{command}\n{out}"
        if "-i " in command:
            assert out.startswith("HTTP/1.1 200"), f"{command}\n{out}"
        elif '"stream": true' in command and "/v1/messages" in command:  # Anthropic's events
            events = [
                json.loads(line[len("data: ") :]) for line in out.splitlines() if line.startswith("data: ")
            ]
            assert events[0]["type"] == "message_start" and events[-1]["type"] == "message_stop", out
        elif '"stream": true' in command:
            events = [line[len("data: ") :] for line in out.splitlines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]" and all(json.loads(e)["id"] for e in events[:-1]), out
        elif "| grep" not in command:
            for line in out.strip().splitlines():  # one JSON body per command in the block
                json.loads(line)
