"""Schemathesis against a live `pagellm serve` and its own /openapi.json: whatever valid or invalid request it
generates, the server never answers 5xx, and every answer is one the schema documents (status, content type,
body, headers; an undocumented method gets 405 with `Allow`). Every route the app serves: a generating server
with the LoRA admin routes on (/v1/load_lora_adapter, /v1/unload_lora_adapter) and the responses store
(/v1/responses, GET /v1/responses/{id}, its cancel) besides the completion, chat, messages, count_tokens,
tokenize and detokenize routes, a pooling server for /v1/embeddings, and a
classifying one for /v1/score, /v1/rerank, /v2/rerank, /classify and /pooling. A fixed seed,
so a failure reproduces; PAGELLM_FUZZ_EXAMPLES (default 300 per operation and phase) scales the run.

Slow (minutes): `pytest -m slow tests/server/test_schemathesis.py`. Schemathesis runs as its command line
does (all its phases); its pytest plugin does not run under pytest 9.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from server_harness import ServerProcess

pytestmark = pytest.mark.slow

# a short context keeps generated completions quick; max_tokens and n beyond it are refused with 400
ENGINE_ARGS = [
    "--dtype",
    "float32",
    "--num-kv-blocks",
    "64",
    "--max-model-len",
    "64",
    "--disable-log-requests",
]
CHECKS = (
    "not_a_server_error",
    "status_code_conformance",
    "content_type_conformance",
    "response_headers_conformance",
    "response_schema_conformance",
    "unsupported_method",
)


SERVERS = {
    "generate": [
        "--enable-lora",
        "--allow-runtime-lora-updating",
        "--max-lora-rank",
        "8",
        "--enable-responses-store",
    ],
    "pooling": ["--runner", "pooling"],
    # the tiny Llama as a one-score classifier (two of its tokens' logits), for /v1/score, rerank, /classify
    "classify": [
        "--runner",
        "pooling",
        "--hf-overrides",
        '{"architectures": ["LlamaForSequenceClassification"], "method": "from_2_way_softmax", '
        '"classifier_from_token": ["<|im_start|>", "<|im_end|>"]}',
    ],
}


@pytest.fixture(scope="module", params=list(SERVERS))
def server(request, tiny_model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("log") / "serve.log"
    proc = ServerProcess(tiny_model_dir, ENGINE_ARGS + SERVERS[request.param], log)
    yield proc
    proc.stop()


def test_the_server_keeps_to_its_schema(server, tmp_path):
    command = [
        sys.executable,
        "-m",
        "schemathesis.cli",
        "run",
        f"{server.url}/openapi.json",
        "--checks",
        ",".join(CHECKS),
        "--phases",
        "examples,coverage,fuzzing",
        "--max-examples",
        os.environ.get("PAGELLM_FUZZ_EXAMPLES", "300"),
        "--seed",
        "0",
        "--request-timeout",
        "60",
        "--generation-database",
        "none",
        "--no-color",
    ]
    run = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, timeout=1200)
    assert run.returncode == 0, (
        f"{run.stdout[-20000:]}\n{run.stderr[-2000:]}\n{server.log_path.read_text()[-5000:]}"
    )
