"""The official openai client (and raw httpx) against an in-process app, without a server process."""

from __future__ import annotations

import asyncio

import httpx
import openai


def call_app(app, work):
    """Run `await work(client, http)` with an AsyncOpenAI client and an httpx client bound to `app`."""

    async def run():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as http:
            client = openai.AsyncOpenAI(
                base_url="http://app/v1", api_key="none", http_client=http, max_retries=0
            )
            return await work(client, http)

    return asyncio.run(run())


async def assert_engine_ended(llm, app) -> None:
    """After its engine died: not running, new requests refused, /health 503."""
    import pytest

    from pagellm.engine.async_llm import EngineError

    assert not llm.is_running
    with pytest.raises(EngineError, match="shut down"):
        await llm.add_request("Hello")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://app") as client:
        assert (await client.get("/health")).status_code == 503
