"""LoRA adapters through the OpenAI server: /v1/models lists them over their base, a request's `model`
picks one (the same tokens as offline), unknown names are 404s, and adapters load and unload at run time."""

from __future__ import annotations

import pytest
from openai_asgi import call_app
from test_lora import make_adapter
from tiny import make_tiny_checkpoint

from pagellm import LLM, AsyncLLM, LoRARequest, SamplingParams
from pagellm.server.app import build_app

SETTINGS = dict(dtype="float32", num_kv_blocks=128, max_model_len=256, enable_lora=True, max_loras=2)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora-serve")
    base = make_tiny_checkpoint("llama", tmp)
    a, b = make_adapter(base, tmp / "a", 4, seed=1)[0], make_adapter(base, tmp / "b", 8, seed=2)[0]
    llm = AsyncLLM(str(base), engine_process=False, **SETTINGS)
    app = build_app(
        llm, ["tiny"], log_requests=False, lora_modules={"sql": str(a)}, allow_runtime_lora_updating=True
    )
    yield base, a, b, app
    llm.shutdown()


def offline(base, adapter, prompt):
    llm = LLM(str(base), **SETTINGS)
    lora = LoRARequest("x", 1, str(adapter)) if adapter else None
    out = llm.generate(
        prompt,
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
        use_tqdm=False,
        lora_request=lora,
    )
    return out[0].outputs[0].text


def test_adapters_by_model_name_and_at_run_time(setup):
    base, a, b, app = setup

    async def work(client, http):
        models = [(m.id, getattr(m, "parent", None)) for m in (await client.models.list()).data]
        kwargs = dict(prompt="Hello there", max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
        texts = {
            name: (await client.completions.create(model=name, **kwargs)).choices[0].text
            for name in ("tiny", "sql")
        }
        missing = await http.post("/v1/completions", json={"model": "nope", "prompt": "x"})
        loaded = await http.post("/v1/load_lora_adapter", json={"lora_name": "chat", "lora_path": str(b)})
        texts["chat"] = (await client.completions.create(model="chat", **kwargs)).choices[0].text
        bad = await http.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/nowhere"})
        unloaded = await http.post("/v1/unload_lora_adapter", json={"lora_name": "chat"})
        gone = await http.post("/v1/completions", json={"model": "chat", "prompt": "x"})
        return models, texts, missing, loaded, bad, unloaded, gone

    models, texts, missing, loaded, bad, unloaded, gone = call_app(app, work)
    assert models == [("tiny", None), ("sql", "tiny")]
    assert texts["tiny"] == offline(base, None, "Hello there")
    assert texts["sql"] == offline(base, a, "Hello there") != texts["tiny"]
    assert texts["chat"] == offline(base, b, "Hello there")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    assert loaded.status_code == 200 and unloaded.status_code == 200
    assert bad.status_code == 400 and "adapter_config.json" in bad.json()["error"]["message"]
    assert gone.status_code == 404
