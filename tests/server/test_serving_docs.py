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


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    args = ["--served-model-name", "SmolLM2-135M-Instruct", "--dtype", "float32", "--num-kv-blocks", "256"]
    proc = ServerProcess(tiny_model_dir, args, tmp_path_factory.mktemp("log") / "serve.log")
    yield proc
    proc.stop()


def test_the_doc_has_curl_examples_for_every_endpoint():
    text = " ".join(curl_examples(DOC))
    for path in ("/v1/models", "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        assert f"localhost:8000{path}" in text
    for path in ("/health", "/version", "/metrics"):
        assert f"localhost:8000{path}" in text


@pytest.mark.skipif(shutil.which("curl") is None, reason="needs curl")
def test_curl_examples_run_as_written(server):
    port = server.url.rsplit(":", 1)[1]
    for command in curl_examples():
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
        elif '"stream": true' in command:
            events = [line[len("data: ") :] for line in out.splitlines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]" and all(json.loads(e)["id"] for e in events[:-1]), out
        elif "| grep" not in command:
            for line in out.strip().splitlines():  # one JSON body per command in the block
                json.loads(line)
