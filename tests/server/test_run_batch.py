"""`pagellm run-batch`: OpenAI batch lines run concurrently through the server's own app, one result line per
input line in input order; what is not a request, a url not run, and what the server refuses each get an
error line, and the rest answer as the endpoints do."""

from __future__ import annotations

import asyncio
import io
import json

from click.testing import CliRunner
from openai_asgi import call_app

from pagellm.cli.main import cli
from pagellm.engine.async_llm import AsyncLLM
from pagellm.server.app import build_app
from pagellm.server.batch import run_batch

GREEDY = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}
COMPLETION = {"model": "tiny", "prompt": "Once upon a time", **GREEDY}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], **GREEDY}


def line(custom_id, url="/v1/completions", body=None, method="POST") -> str:
    return json.dumps({"custom_id": custom_id, "method": method, "url": url, "body": body or COMPLETION})


LINES = [
    line("a"),
    line("b", "/v1/chat/completions", CHAT),
    "not json",
    line("d", "/v1/moderations", {"model": "tiny", "input": "Hi"}),
    line("e", body={**COMPLETION, "temperature": -1}),
    line("f", method="GET"),
    line("g", body={**COMPLETION, "stream": True}),
    line("h", body={**COMPLETION, "model": "nope"}),
    "",
    *(line(f"many-{i}", body={**COMPLETION, "prompt": f"Count {i}"}) for i in range(6)),
]


def check(results: list[dict], expected_completion: str, expected_chat: str) -> None:
    assert len(results) == len(LINES)
    assert [r["custom_id"] for r in results[:9]] == ["a", "b", None, "d", "e", "f", "g", "h", None]
    assert all(r["id"].startswith("batch_req_") for r in results)
    a, b, bad_json, moderations, refused, get, stream, unknown, empty = results[:9]
    for ok in (a, b, *results[9:]):
        assert ok["error"] is None and ok["response"]["status_code"] == 200
        assert ok["response"]["request_id"] == ok["response"]["body"]["id"]
    assert a["response"]["body"]["choices"][0]["text"] == expected_completion
    assert b["response"]["body"]["choices"][0]["message"]["content"] == expected_chat
    for failed, code in ((bad_json, "invalid_request"), (moderations, "not_found"), (get, "invalid_request"),
                         (stream, "invalid_request"), (empty, "invalid_request")):  # fmt: skip
        assert failed["response"] is None and failed["error"]["code"] == code, failed
    assert "/v1/moderations" in moderations["error"]["message"] and "stream" in stream["error"]["message"]
    assert "/v1/embeddings" in moderations["error"]["message"]  # named among the urls that run
    assert refused["response"]["status_code"] == 400 and "temperature" in refused["error"]["message"]
    assert refused["response"]["body"]["error"]["param"] == "temperature"
    assert unknown["response"]["status_code"] == 404 and unknown["error"]["code"] == "model_not_found"


def expected(app) -> tuple[str, str]:
    async def work(client, http):
        completion = (await http.post("/v1/completions", json=COMPLETION)).json()
        chat = (await http.post("/v1/chat/completions", json=CHAT)).json()
        return completion["choices"][0]["text"], chat["choices"][0]["message"]["content"]

    return call_app(app, work)


def test_lines_run_concurrently_and_answer_in_order(llm):
    app = build_app(llm, ["tiny"], log_requests=False)
    running, peak = 0, 0

    async def counting(scope, receive, send):
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        try:
            await app(scope, receive, send)
        finally:
            running -= 1

    out = io.StringIO()
    failed = asyncio.run(run_batch(counting, LINES, out, progress=False))
    results = [json.loads(r) for r in out.getvalue().splitlines()]
    check(results, *expected(app))
    assert failed == 7 and peak > 1


def test_the_command_reads_and_writes_files(llm, tmp_path, tiny_model_dir, monkeypatch):
    configs = []

    def from_config(cls, config):
        configs.append(config)
        return llm

    monkeypatch.setattr(AsyncLLM, "from_config", classmethod(from_config))
    monkeypatch.setattr(llm, "shutdown", lambda: None)  # the session's engine outlives the command
    requests, results = tmp_path / "requests.jsonl", tmp_path / "results.jsonl"
    requests.write_text("\n".join(LINES) + "\n")
    args = ["run-batch", "-i", str(requests), "-o", str(results), "--model", str(tiny_model_dir)]
    args += ["--served-model-name", "tiny", "--dtype", "float32", "--max-concurrency", "3"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    assert f"{len(LINES)} requests, 7 with errors" in result.output
    assert configs[0].model == str(tiny_model_dir) and configs[0].dtype == "float32"
    check([json.loads(r) for r in results.read_text().splitlines()], *expected(build_app(llm, ["tiny"])))


def test_embedding_lines_run_on_a_pooling_engine(pooling_llm, llm):
    lines = [
        line("e1", "/v1/embeddings", {"model": "tiny", "input": ["Hi", "Once upon a time"]}),
        line("e2", "/v1/embeddings", {"model": "tiny", "input": "Hi", "encoding_format": "base64"}),
        line("e3", "/v1/embeddings", {"model": "tiny", "input": "Hi", "dimensions": 8}),
        line("c", body=COMPLETION),
    ]
    out = io.StringIO()
    failed = asyncio.run(
        run_batch(build_app(pooling_llm, ["tiny"], log_requests=False), lines, out, progress=False)
    )
    e1, e2, e3, c = [json.loads(r) for r in out.getvalue().splitlines()]
    assert failed == 2 and e1["error"] is None and e2["error"] is None
    body = e1["response"]["body"]
    assert e1["response"]["request_id"] == body["id"] and body["object"] == "list"
    assert [len(d["embedding"]) for d in body["data"]] == [64, 64]
    assert isinstance(e2["response"]["body"]["data"][0]["embedding"], str)
    assert e3["response"]["status_code"] == 400 and e3["response"]["body"]["error"]["param"] == "dimensions"
    assert c["response"]["status_code"] == 400 and "/v1/embeddings" in c["error"]["message"]
    # a generating engine answers an embeddings line 400 that names the flag
    out = io.StringIO()
    asyncio.run(run_batch(build_app(llm, ["tiny"], log_requests=False), lines[:1], out, progress=False))
    refused = json.loads(out.getvalue())
    assert refused["response"]["status_code"] == 400 and "--runner pooling" in refused["error"]["message"]
