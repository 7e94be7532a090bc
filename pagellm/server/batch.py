"""OpenAI's batch file format, run through the server's own app (`pagellm run-batch`).

Each input line is `{"custom_id", "method": "POST", "url", "body"}`; each output line is `{"id", "custom_id",
"response": {"status_code", "request_id", "body"}, "error"}`, one per input line and in input order. The
requests go to the app in-process, all at once (up to a bound), so the engine batches them as it batches a
server's clients, and each is validated exactly as the server validates it. `error` is set (`{"code",
"message"}`) for a line that is not a request, a url the batch does not run (`response` is then null), and a
request the server refused (`response` holds its status and error body).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Sequence
from typing import Any, TextIO

import httpx
from starlette.types import ASGIApp
from tqdm import tqdm

from pagellm.server.limits import DEFAULT_BATCH_CONCURRENCY

BATCH_URLS = ("/v1/completions", "/v1/chat/completions", "/v1/embeddings")


async def run_batch(
    app: ASGIApp,
    lines: Sequence[str],
    out: TextIO,
    max_concurrency: int = DEFAULT_BATCH_CONCURRENCY,
    progress: bool = True,
) -> int:
    """Run every line through `app` concurrently and write each result line to `out` in input order, as soon
    as it and all before it are done. Returns how many lines got an error."""
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)  # a 500 is a result, not a crash
    async with httpx.AsyncClient(transport=transport, base_url="http://batch", timeout=None) as client:
        bound = asyncio.Semaphore(max_concurrency)

        async def one(line: str) -> dict[str, Any]:
            async with bound:
                return await _run_line(client, line)

        failed = 0
        with tqdm(total=len(lines), desc="batch", unit="req", disable=not progress) as bar:
            tasks = [asyncio.create_task(one(line)) for line in lines]
            for task in tasks:
                task.add_done_callback(lambda _: bar.update())
            try:
                for task in tasks:
                    result = await task
                    failed += result["error"] is not None
                    out.write(json.dumps(result) + "\n")
                    out.flush()
            finally:
                for task in tasks:
                    task.cancel()
        return failed


async def _run_line(client: httpx.AsyncClient, line: str) -> dict[str, Any]:
    try:
        request = json.loads(line)
    except ValueError as exc:
        return _result(None, "invalid_request", f"the line is not JSON: {exc}")
    if not isinstance(request, dict):
        return _result(None, "invalid_request", "the line is not a JSON object")
    custom_id = request.get("custom_id")
    body = request.get("body")
    url = request.get("url")
    if not isinstance(custom_id, str):
        return _result(None, "invalid_request", "custom_id must be a string")
    if request.get("method") != "POST":
        return _result(custom_id, "invalid_request", f"method must be POST, got {request.get('method')!r}")
    if url not in BATCH_URLS:
        return _result(
            custom_id, "not_found", f"url {url!r} is not served here; use one of {', '.join(BATCH_URLS)}"
        )
    if not isinstance(body, dict):
        return _result(custom_id, "invalid_request", "body must be a JSON object")
    if body.get("stream"):
        return _result(custom_id, "invalid_request", "body.stream: a batch request cannot stream")
    try:
        response = await client.post(url, json=body)
        payload = response.json()
    except Exception as exc:  # the app answered something that is not JSON; the batch goes on
        return _result(custom_id, "server_error", f"the request failed: {exc}")
    answered = {
        "status_code": response.status_code,
        "request_id": payload.get("id") or f"batch-{uuid.uuid4().hex}",
        "body": payload,
    }
    if response.status_code < 400:
        return _result(custom_id, response=answered)
    error = payload.get("error") or {}
    code = error.get("code") or error.get("type") or str(response.status_code)
    return _result(custom_id, code, str(error.get("message", response.text)), answered)


def _result(
    custom_id: str | None,
    code: str | None = None,
    message: str = "",
    response: dict[str, Any] | None = None,
) -> dict[str, Any]:
    return {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": custom_id,
        "response": response,
        "error": None if code is None else {"code": code, "message": message},
    }
