"""Speculative decoding behind the OpenAI server: streamed completions are the same, and /metrics counts
drafts and acceptances (vLLM's names, under `pagellm:`)."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import pytest
from tiny import make_tiny_checkpoint

from pagellm import AsyncLLM
from pagellm.server.app import build_app


@pytest.fixture(scope="module")
def spec_llm(tmp_path_factory):
    path = make_tiny_checkpoint("llama", tmp_path_factory.mktemp("spec-serve"))
    llm = AsyncLLM(
        str(path), dtype="float32", num_kv_blocks=64, max_model_len=128, engine_process=False,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
    )  # fmt: skip
    yield llm
    llm.shutdown()


def test_streamed_and_whole_completions_agree_and_metrics_count_drafts(spec_llm):
    app = build_app(spec_llm, ["tiny"], log_requests=False)

    async def run():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
            body = {"prompt": [17, 18, 19] * 20, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
            whole = (await client.post("/v1/completions", json=body)).json()["choices"][0]["text"]
            streamed = await client.post("/v1/completions", json={**body, "stream": True})
            events = [line[6:] for line in streamed.text.splitlines() if line.startswith("data: {")]
            assert "".join(json.loads(e)["choices"][0]["text"] for e in events) == whole
            return (await client.get("/metrics")).text

    metrics = asyncio.run(run())
    drafts = float(
        re.search(r'pagellm:spec_decode_num_draft_tokens_total\{model_name="tiny"\} (\S+)', metrics)[1]
    )
    accepted = float(
        re.search(r'pagellm:spec_decode_num_accepted_tokens_total\{model_name="tiny"\} (\S+)', metrics)[1]
    )
    first = re.search(
        r'pagellm:spec_decode_num_accepted_tokens_per_pos_total\{model_name="tiny",position="0"\} (\S+)',
        metrics,
    )
    assert drafts > 0 and 0 < accepted <= drafts
    assert first is not None and float(first[1]) <= accepted
