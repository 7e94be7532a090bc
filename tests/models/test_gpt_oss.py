"""GPT-OSS against transformers on tiny checkpoints: logits through prefill and decode across the sliding
windows, that the tiny model's sinks and SwiGLU clamp change its output (so parity tests them), MXFP4
experts read from `*_blocks` / `*_scales` and dequantized like transformers does, and the harmony chat
format through the server. Greedy parity through the engine (chunked prefill, preemption, prefix hits) is
in tests/engine/test_family_parity.py (FAMILIES)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest
import torch
from models_harness import PagedRunner, load_pagellm, load_reference, reference_logits
from parity import Reference, assert_greedy_parity, mixed_prompts
from safetensors.torch import load_file, save_file
from tiny import make_tiny_checkpoint

from pagellm import LLM, AsyncLLM
from pagellm.core import moe
from pagellm.core.mxfp4 import BLOCK_SIZE
from pagellm.server.app import build_app

ATOL = 1e-4
PROMPT = [5, 77, 200, 13, 150, 42, 99, 260, 301, 7, 64, 120, 33]  # longer than the 8-token window


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_tiny_checkpoint("gpt_oss", tmp_path_factory.mktemp("gpt_oss"))


def assert_logits_match(path: Path) -> None:
    reference = load_reference(path)
    runner = PagedRunner(load_pagellm(path), num_seqs=1)
    ids = list(PROMPT)
    got = runner.step({0: ids})[0]
    torch.testing.assert_close(got, reference_logits(reference, ids), atol=ATOL, rtol=0)
    for _ in range(4):
        ids.append(int(got[-1].argmax()))
        got = runner.step({0: ids[-1:]})[0]
        torch.testing.assert_close(got[-1], reference_logits(reference, ids)[-1], atol=ATOL, rtol=0)


def test_prefill_and_decode_match_transformers(checkpoint):
    assert_logits_match(checkpoint)


def test_attention_specs_follow_layer_types(checkpoint):
    from transformers import AutoConfig

    from pagellm.models.gpt_oss import GptOssForCausalLM

    config = AutoConfig.from_pretrained(checkpoint)
    specs = [GptOssForCausalLM.attention_spec(config, torch.float32, 16, i) for i in range(4)]
    assert [s.sliding_window for s in specs] == [8, None, 8, None]
    assert all(s.has_sinks for s in specs)
    assert {s.softmax_scale for s in specs} == {16**-0.5}


def test_the_sinks_and_the_swiglu_clamp_change_the_tiny_models_output(checkpoint, monkeypatch):
    """Were either missing, the logits parity above and the family's greedy parity would still have to
    fail: the tiny model's weights make both matter."""
    model = load_pagellm(checkpoint)
    base = PagedRunner(model, num_seqs=1).step({0: PROMPT})[0]

    activate = moe.activate
    with monkeypatch.context() as m:
        m.setattr(
            moe, "activate", lambda gate_up, activation: activate(gate_up, activation, swiglu_limit=1e9)
        )
        unclamped = PagedRunner(model, num_seqs=1).step({0: PROMPT})[0]
    assert (base - unclamped).abs().max() > 1e-2

    for layer in model.attention_layers():
        layer.sinks.zero_()
    no_sinks = PagedRunner(model, num_seqs=1).step({0: PROMPT})[0]
    assert (base - no_sinks).abs().max() > 1e-2


def write_mxfp4_experts(path: Path) -> None:
    """Replace the checkpoint's expert weights by random MXFP4 ones, as gpt-oss's files hold them: per
    projection `<name>_blocks` uint8 [E, N, K/32, 16] and `<name>_scales` uint8 [E, N, K/32] for the weight
    transformers keeps as [E, K, N] (x @ W), and a `quantization_config` naming mxfp4."""
    state = load_file(str(path / "model.safetensors"))
    generator = torch.Generator().manual_seed(0)
    for name in [n for n in state if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, k, n = state.pop(name).shape
        groups = k // BLOCK_SIZE
        state[f"{name}_blocks"] = torch.randint(
            0, 256, (experts, n, groups, BLOCK_SIZE // 2), generator=generator, dtype=torch.uint8
        )
        # 2^-6 .. 2^-3 times FP4 values up to 6: weights of the size of the tiny model's others
        scales = torch.randint(121, 125, (experts, n, groups), generator=generator)
        state[f"{name}_scales"] = scales.to(torch.uint8)
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    }
    (path / "config.json").write_text(json.dumps(config))


def test_mxfp4_experts_load_as_transformers_dequantizes_them(tmp_path):
    """transformers reads the pairs with its own dequantization (on a CPU it dequantizes instead of
    running MXFP4 kernels); the engine selects no quantization method for them (the model reads them)."""
    path = make_tiny_checkpoint("gpt_oss", tmp_path)
    write_mxfp4_experts(path)
    assert_logits_match(path)

    llm = LLM(str(path), dtype="float32", num_kv_blocks=64, max_model_len=256)
    assert llm.engine.setup.quant_method is None
    assert_greedy_parity(llm, Reference(path, 8), mixed_prompts(300)[:4])


def test_harmony_chat_through_the_server_matches_transformers(checkpoint):
    llm = AsyncLLM(str(checkpoint), dtype="float32", num_kv_blocks=64, max_model_len=256)
    app = build_app(llm, ["tiny"], log_requests=False)
    tokenizer = llm.tokenizer
    messages = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Hello, how are you today?"},
        {"role": "assistant", "content": "I am fine.", "thinking": "Say how I am."},
        {"role": "user", "content": "Once upon a time"},
    ]
    expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert expected.startswith("<|start|>system<|message|>") and expected.endswith(
        "<|start|>user<|message|>Once upon a time<|end|><|start|>assistant"
    )
    assert "<|start|>assistant<|channel|>analysis<|message|>Say how I am.<|end|>" in expected
    prompt = tokenizer.encode(expected, add_special_tokens=False)
    theirs = Reference(checkpoint, 8).generate(prompt)

    async def run():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
            tokens = (await client.post("/tokenize", json={"messages": messages})).json()["tokens"]
            body = {"messages": messages, "max_tokens": 8, "temperature": 0}
            response = (await client.post("/v1/chat/completions", json=body)).json()
            return tokens, response

    try:
        tokens, response = asyncio.run(run())
    finally:
        llm.shutdown()
    assert tokens == prompt
    assert response["usage"]["prompt_tokens"] == len(prompt)
    assert response["choices"][0]["message"]["content"] == tokenizer.decode(theirs, skip_special_tokens=True)
