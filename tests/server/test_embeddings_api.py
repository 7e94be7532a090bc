"""`/v1/embeddings` through the official openai client: float and base64 encodings (the client's default is
base64), every input shape, usage, `dimensions` refused with 400 naming it on a model without Matryoshka
support, and each endpoint refusing the other runner's requests."""

from __future__ import annotations

import base64
import struct

import numpy as np
import openai
import pytest
import torch
from openai_asgi import call_app

from pagellm.server.app import build_app
from pagellm.server.serving_embedding import encode_embedding

TEXTS = ["Hello, world!", "The quick brown fox jumps over the lazy dog."]


@pytest.fixture(scope="module")
def app(pooling_llm):
    return build_app(pooling_llm, ["tiny"], log_requests=False)


@pytest.fixture(scope="module")
def oracle(tiny_model_dir):
    """The transformers base model's last-position hidden state, L2-normalised: what LAST pooling gives."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()

    def embed(token_ids: list[int]) -> np.ndarray:
        with torch.no_grad():
            hidden = model(input_ids=torch.tensor([token_ids])).last_hidden_state[0, -1]
        return torch.nn.functional.normalize(hidden, dim=-1).numpy()

    return embed


def test_the_openai_client_gets_embeddings_in_both_encodings(app, pooling_llm, oracle):
    tokenizer = pooling_llm.tokenizer
    ids = [tokenizer.encode(t) for t in TEXTS]

    async def work(client, http):
        default = await client.embeddings.create(model="tiny", input=TEXTS)  # base64 on the wire
        floats = await client.embeddings.create(model="tiny", input=TEXTS, encoding_format="float")
        raw = (await http.post("/v1/embeddings", json={"input": TEXTS, "encoding_format": "base64"})).json()
        one = await client.embeddings.create(model="tiny", input=TEXTS[0], encoding_format="float")
        one_ids = await client.embeddings.create(model="tiny", input=ids[1], encoding_format="float")
        many_ids = await client.embeddings.create(model="tiny", input=ids)
        models = await client.models.list()
        return default, floats, raw, one, one_ids, many_ids, models

    default, floats, raw, one, one_ids, many_ids, models = call_app(app, work)
    assert [m.id for m in models.data] == ["tiny"]
    assert floats.object == "list" and floats.model == "tiny"
    assert [d.index for d in floats.data] == [0, 1] and all(d.object == "embedding" for d in floats.data)
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == sum(map(len, ids))
    same = dict(atol=1e-6, rtol=0)  # requests batched differently differ in the last bits
    for i, token_ids in enumerate(ids):
        want = oracle(token_ids)
        assert np.allclose(floats.data[i].embedding, want, atol=1e-5)
        assert len(default.data[i].embedding) == 64
        assert np.allclose(default.data[i].embedding, floats.data[i].embedding, **same)
        decoded = np.frombuffer(base64.b64decode(raw["data"][i]["embedding"]), dtype="<f4")
        assert np.allclose(decoded, floats.data[i].embedding, **same)
        assert np.allclose(many_ids.data[i].embedding, floats.data[i].embedding, **same)
    assert raw["usage"] == {"prompt_tokens": sum(map(len, ids)), "total_tokens": sum(map(len, ids))}
    assert len(one.data) == 1 and np.allclose(one.data[0].embedding, floats.data[0].embedding, **same)
    assert np.allclose(one_ids.data[0].embedding, floats.data[1].embedding, **same)
    assert one.usage.prompt_tokens == len(ids[0])


def test_base64_is_little_endian_float32():
    encoded = encode_embedding([1.5, -2.0, 0.1], "base64")
    assert base64.b64decode(encoded) == struct.pack("<3f", 1.5, -2.0, 0.1)
    assert encode_embedding([1.5], "float") == [1.5]


def test_bad_requests_answer_400_naming_the_field(app, llm):
    async def work(client, http):
        errors = {}
        for name, kwargs in {
            "dimensions": dict(input="Hi", dimensions=8),
            "input": dict(input=[]),
            "too_long": dict(input=[5] * 200),
            "bad_id": dict(input=[10**6]),
        }.items():
            with pytest.raises(openai.BadRequestError) as caught:
                await client.embeddings.create(model="tiny", **kwargs)
            errors[name] = caught.value
        with pytest.raises(openai.NotFoundError):
            await client.embeddings.create(model="nope", input="Hi")
        with pytest.raises(openai.BadRequestError) as caught:
            await client.completions.create(model="tiny", prompt="Hi", max_tokens=2)
        errors["completions"] = caught.value
        return errors

    errors = call_app(app, work)
    assert errors["dimensions"].param == "dimensions" and "Matryoshka" in errors["dimensions"].message
    for name in ("input", "too_long", "bad_id"):
        assert errors[name].param == "input", errors[name]
    assert "max_model_len" in errors["too_long"].message
    assert "/v1/embeddings" in errors["completions"].message

    async def on_a_generating_server(client, http):
        with pytest.raises(openai.BadRequestError) as caught:
            await client.embeddings.create(model="tiny", input="Hi")
        return caught.value

    refused = call_app(build_app(llm, ["tiny"], log_requests=False), on_a_generating_server)
    assert refused.param == "model" and "--runner pooling" in refused.message
