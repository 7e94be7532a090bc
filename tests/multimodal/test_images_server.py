"""Images through the server: the official `openai` client sends an image as a data URL in a chat message and
the `anthropic` client as a base64 image block, against the app over an engine process, and each gets the
tokens offline `LLM.chat` gives for the same image; bad media (undecodable, not an image, a decompression
bomb, too many images, a host or a local file the limits refuse) each answer 400 naming the part, and the
server keeps serving."""

from __future__ import annotations

import base64
import io

import anthropic
import httpx2
import pytest
from openai_asgi import call_app
from tiny_vlm import images, make_tiny_llava

from pagellm import LLM, AsyncLLM, SamplingParams
from pagellm.server.app import build_app

MAX_TOKENS = 8
ENGINE = dict(dtype="float32", max_model_len=96, num_kv_blocks=64, limit_mm_per_prompt='{"image": 2}')
PICTURES = images(2, seed=3)


def data_url(image, fmt: str = "PNG") -> str:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buffer.getvalue()).decode()


def ask(url: str, text: str = "what is in") -> list[dict]:
    return [
        {
            "role": "user",
            "content": [{"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": url}}],
        }
    ]


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    return make_tiny_llava(tmp_path_factory.mktemp("llava"))


@pytest.fixture(scope="module")
def app(llava):
    llm = AsyncLLM(str(llava), allowed_media_domains=["images.example"], **ENGINE)  # an engine process
    yield build_app(llm, ["tiny"], log_requests=False)
    llm.shutdown()


@pytest.fixture(scope="module")
def offline(llava):
    llm = LLM(str(llava), **ENGINE)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    return lambda messages: llm.chat(messages, params, use_tqdm=False)[0].outputs[0].text


def test_openai_and_anthropic_clients_get_offline_chats_tokens(app, offline):
    url = data_url(PICTURES[0])

    async def work(client, http):
        chat = await client.chat.completions.create(
            model="tiny", messages=ask(url), max_tokens=MAX_TOKENS, temperature=0
        )
        transport = httpx2.ASGITransport(app=app)  # the anthropic client's own httpx
        async with httpx2.AsyncClient(transport=transport, base_url="http://app") as raw:
            claude = anthropic.AsyncAnthropic(
                base_url="http://app", api_key="none", http_client=raw, max_retries=0
            )
            message = await claude.messages.create(
                model="tiny",
                max_tokens=MAX_TOKENS,
                messages=[
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "what is in"},
                            {
                                "type": "image",
                                "source": {
                                    "type": "base64",
                                    "media_type": "image/png",
                                    "data": url.split(",", 1)[1],
                                },
                            },
                        ],
                    }
                ],
                extra_body={"temperature": 0},
            )
        return chat, message

    chat, message = call_app(app, work)
    expected = offline(ask(url))
    assert chat.choices[0].message.content == expected
    assert chat.usage.prompt_tokens > 16  # the image's 16 tokens counted
    assert message.content[0].text == expected
    assert message.usage.input_tokens == chat.usage.prompt_tokens


def bomb() -> str:
    """A PNG of a few hundred bytes that declares 9000 x 9000 pixels."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("1", (9000, 9000)).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


@pytest.mark.parametrize(
    ("messages", "needle"),
    [
        (ask("data:image/png;base64,AAAA"), "messages[0].content[1]"),
        (
            ask("data:image/png;base64," + base64.b64encode(b"just some text, not a picture").decode()),
            "messages[0].content[1]",
        ),
        (ask(bomb()), "messages[0].content[1]"),
        (ask("http://127.0.0.1:9/cat.png"), "messages[0].content[1]"),
        (ask("file:///etc/passwd"), "messages[0].content[1]"),
        (
            [
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": data_url(p)}} for p in PICTURES * 2
                    ][:3],
                }
            ],
            "messages[0].content[2]",
        ),
    ],
    ids=["undecodable", "not-an-image", "decompression-bomb", "host-not-allowed", "local-file", "too-many"],
)
def test_bad_media_is_a_400_naming_the_part_and_the_server_keeps_serving(app, offline, messages, needle):
    good = ask(data_url(PICTURES[1]))

    async def work(client, http):
        bad = await http.post(
            "/v1/chat/completions", json={"model": "tiny", "messages": messages, "max_tokens": 2}
        )
        ok = await client.chat.completions.create(
            model="tiny", messages=good, max_tokens=MAX_TOKENS, temperature=0
        )
        return bad, ok

    bad, ok = call_app(app, work)
    assert bad.status_code == 400, bad.text
    assert bad.json()["error"]["param"] == needle
    assert "/etc/passwd" not in bad.text or "root:" not in bad.text  # the file's content never comes back
    assert ok.choices[0].message.content == offline(good)


def test_a_text_only_model_refuses_an_image_naming_the_part(tmp_path):
    from tiny import make_tiny_checkpoint

    llm = AsyncLLM(
        str(make_tiny_checkpoint("llama", tmp_path)),
        dtype="float32",
        num_kv_blocks=16,
        max_model_len=64,
        engine_process=False,
    )
    try:
        app = build_app(llm, ["tiny"], log_requests=False)

        async def work(client, http):
            return await http.post(
                "/v1/chat/completions",
                json={"model": "tiny", "messages": ask(data_url(PICTURES[0])), "max_tokens": 2},
            )

        response = call_app(app, work)
        assert response.status_code == 400
        assert response.json()["error"]["param"] == "messages[0].content[1]"
        assert "takes no images" in response.json()["error"]["message"]
    finally:
        llm.shutdown()
