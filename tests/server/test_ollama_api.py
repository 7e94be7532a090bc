"""Ollama's API through the official `ollama` client (its pydantic response types validate every answer):
chat and generate, whole and streamed, give the same greedy tokens as the OpenAI endpoints; options map to
sampling, `format` to structured output, tool calls come back as Ollama's objects; embed equals
/v1/embeddings; tags, show, ps and version describe the served model; bad requests get 400 with Ollama's
`{"error": ...}` naming the field."""

from __future__ import annotations

import json

import httpx
import ollama
import pytest

from pagellm.server.app import build_app
from pagellm.server.serving_chat import ServingChat, tool_parser
from pagellm.server.serving_models import ServedModels
from pagellm.server.serving_ollama import OllamaReply

GREEDY = {"temperature": 0, "num_predict": 8}
MESSAGES = [{"role": "user", "content": "Say hello."}]


def call(app, work):
    """`await work(ollama client, openai-style httpx client)` against the in-process app."""
    import asyncio

    async def run():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as http:
            client = ollama.AsyncClient(host="http://app", transport=transport)
            try:
                return await work(client, http)
            finally:
                await client.close()

    return asyncio.run(run())


@pytest.fixture(scope="module")
def app(llm):
    return build_app(llm, ["tiny"], log_requests=False)


async def _collect(stream):
    parts = [part async for part in stream]
    return parts


def test_chat_and_generate_give_the_openai_endpoints_tokens(app):
    async def work(client, http):
        openai_chat = (
            await http.post(
                "/v1/chat/completions", json={"messages": MESSAGES, "temperature": 0, "max_tokens": 8}
            )
        ).json()
        openai_raw = (
            await http.post(
                "/v1/completions", json={"prompt": "Once upon a time", "temperature": 0, "max_tokens": 8}
            )
        ).json()
        whole = await client.chat(model="tiny", messages=MESSAGES, options=GREEDY, keep_alive="5m")
        streamed = await _collect(
            await client.chat(model="tiny:latest", messages=MESSAGES, options=GREEDY, stream=True)
        )
        generated = await client.generate(model="tiny", prompt="Say hello.", options=GREEDY)
        pieces = await _collect(
            await client.generate(model="tiny", prompt="Say hello.", options=GREEDY, stream=True)
        )
        raw = await client.generate(model="tiny", prompt="Once upon a time", raw=True, options=GREEDY)
        return openai_chat, openai_raw, whole, streamed, generated, pieces, raw

    openai_chat, openai_raw, whole, streamed, generated, pieces, raw = call(app, work)
    text, usage = openai_chat["choices"][0]["message"]["content"], openai_chat["usage"]
    assert isinstance(whole, ollama.ChatResponse) and whole.done and whole.message.role == "assistant"
    assert whole.message.content == text and text
    assert whole.eval_count == usage["completion_tokens"] == 8 and whole.done_reason == "length"
    assert whole.prompt_eval_count == usage["prompt_tokens"]
    assert whole.total_duration >= whole.eval_duration > 0
    assert all(not p.done for p in streamed[:-1]) and streamed[-1].done and streamed[-1].eval_count == 8
    assert "".join(p.message.content for p in streamed) == text
    assert generated.response == text and "".join(p.response for p in pieces) == text
    assert pieces[-1].done and pieces[-1].prompt_eval_count == usage["prompt_tokens"]
    assert raw.response == openai_raw["choices"][0]["text"]


def test_format_is_structured_output(app):
    schema = {"type": "string", "enum": ["yes", "no"]}

    async def work(client, http):
        return await client.chat(
            model="tiny", messages=MESSAGES, format=schema, options={"temperature": 0.8, "seed": 3}
        )

    reply = call(app, work)
    assert json.loads(reply.message.content) in ("yes", "no")


def test_model_routes_describe_the_served_model(app, llm):
    async def work(client, http):
        return (
            await client.list(),
            await client.show("tiny"),
            await client.ps(),
            (await http.get("/api/version")).json(),
        )

    listed, shown, running, version = call(app, work)
    assert [m.model for m in listed.models] == ["tiny"]
    entry = listed.models[0]
    assert entry.size > 0 and entry.details.family == "llama" and len(entry.digest) == 64
    assert (
        shown.capabilities == ["completion"] and shown.modelinfo["llama.context_length"] == llm.max_model_len
    )
    assert "im_start" in shown.template
    assert [m.model for m in running.models] == ["tiny"] and running.models[
        0
    ].context_length == llm.max_model_len
    from pagellm import __version__

    assert version == {"version": __version__}


def test_embed_equals_the_openai_embeddings(pooling_llm):
    texts = ["Hello, world!", "The quick brown fox jumps over the lazy dog."]

    async def work(client, http):
        openai = (await http.post("/v1/embeddings", json={"input": texts})).json()
        embedded = await client.embed(model="tiny", input=texts)
        long = await client.embed(
            model="tiny", input="word " * 400
        )  # truncated to the context, as Ollama does
        with pytest.raises(ollama.ResponseError) as refused:
            await client.embed(model="tiny", input="word " * 400, truncate=False)
        return openai, embedded, long, refused.value

    openai, embedded, long, refused = call(build_app(pooling_llm, ["tiny"], log_requests=False), work)
    assert embedded.prompt_eval_count == openai["usage"]["prompt_tokens"]
    for got, want in zip(embedded.embeddings, openai["data"], strict=True):
        assert got == pytest.approx(want["embedding"], abs=1e-6)
    assert len(long.embeddings[0]) == 64 and long.prompt_eval_count == 128
    assert refused.status_code == 400 and refused.error.startswith("input")


def test_bad_requests_answer_ollama_errors_naming_the_field(app):
    async def work(client, http):
        answers = {}
        for field, body in {
            "options.mirostat": {"messages": MESSAGES, "options": {"mirostat": 2}},
            "options.num_predict": {"messages": MESSAGES, "options": {"num_predict": 100000}},
            "tools": {"messages": MESSAGES, "tools": [{"type": "function", "function": {"name": "f"}}]},
            "think": {"messages": MESSAGES, "think": True},
            "messages": {"messages": []},
        }.items():
            answers[field] = await http.post("/api/chat", json={"model": "tiny", **body})
        answers["model"] = await http.post("/api/chat", json={"model": "nope", "messages": MESSAGES})
        with pytest.raises(ollama.ResponseError) as caught:
            await client.chat(model="nope", messages=MESSAGES)
        return answers, caught.value

    answers, missing = call(app, work)
    for field, answer in answers.items():
        assert answer.status_code == (404 if field == "model" else 400), answer.text
        assert set(answer.json()) == {"error"} and field in answer.json()["error"], (field, answer.text)
    assert missing.status_code == 404


def test_tool_calls_come_back_as_ollama_objects(llm):
    """A reply with a hermes tool call, as /api/chat answers it: the call's arguments an object."""
    chat = ServingChat(
        llm, ServedModels(llm, ["tiny"]), tool_call_parser="hermes", enable_auto_tool_choice=True
    )
    reply = OllamaReply(chat, "tiny", "chat", 0, tool_parser("hermes"), thinks=False)
    text = 'Checking.<tool_call>{"name": "weather", "arguments": {"city": "Paris"}}</tool_call>'
    body = reply._body(reply._message(text))
    message = ollama.Message.model_validate(body["message"])
    assert message.content == "Checking."
    assert [(c.function.name, dict(c.function.arguments)) for c in message.tool_calls] == [
        ("weather", {"city": "Paris"})
    ]


@pytest.mark.slow
def test_images_reach_a_model_that_takes_them(tmp_path):
    """A base64 image in an Ollama message gets the tokens the OpenAI endpoint gives for it as a data URL."""
    import base64
    import io

    from tiny_vlm import images, make_tiny_llava

    from pagellm import AsyncLLM

    buffer = io.BytesIO()
    images(1, seed=3)[0].save(buffer, format="PNG")
    picture = base64.b64encode(buffer.getvalue()).decode()
    llm = AsyncLLM(
        str(make_tiny_llava(tmp_path)),
        dtype="float32",
        max_model_len=96,
        num_kv_blocks=64,
        engine_process=False,
    )
    url = {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{picture}"}}
    openai_messages = [{"role": "user", "content": [{"type": "text", "text": "what is in"}, url]}]

    async def work(client, http):
        body = {"messages": openai_messages, "temperature": 0, "max_tokens": 8}
        openai = (await http.post("/v1/chat/completions", json=body)).json()
        message = {"role": "user", "content": "what is in", "images": [picture]}
        return openai, await client.chat(model="tiny", messages=[message], options=GREEDY)

    try:
        openai, reply = call(build_app(llm, ["tiny"], log_requests=False), work)
    finally:
        llm.shutdown()
    assert reply.message.content == openai["choices"][0]["message"]["content"]
    assert reply.prompt_eval_count == openai["usage"]["prompt_tokens"] > 20


def test_a_gguf_model_reports_the_files_type_as_its_quantization_level(tmp_path):
    """Ollama names a GGUF model's quantization by the file's type (`Q8_0`), not the converted config's dtype."""
    from types import SimpleNamespace

    import gguf
    import numpy as np

    from pagellm.server.ollama_models import OllamaModels

    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_array("tokenizer.ggml.tokens", ["a", "b"])
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    writer.add_tensor("token_embd.weight", np.zeros((2, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    models = OllamaModels.__new__(OllamaModels)  # the parts `_details` reads, without an engine
    models.chat = SimpleNamespace(served=SimpleNamespace(names=["m"], loras={}))
    models.config = {"model_type": "llama", "dtype": "float32"}
    models.source = str(path)
    assert models._details("m").quantization_level == "Q8_0" and models._details("m").format == "gguf"
    models.source = str(tmp_path)  # a checkpoint directory: its dtype, as before
    del models.__dict__["_file_type"]
    assert models._details("m").quantization_level == "FLOAT32"
