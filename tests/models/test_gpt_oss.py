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
from openai_asgi import call_app
from parity import Reference, assert_greedy_parity, mixed_prompts
from safetensors.torch import load_file, save_file
from tiny import make_tiny_checkpoint

from pagellm import LLM, AsyncLLM
from pagellm.core import moe
from pagellm.core.mxfp4 import BLOCK_SIZE
from pagellm.core.platform import Platform
from pagellm.models.layers.fused_moe.layer import FusedMoE, place_mxfp4_experts
from pagellm.platforms import cpu_gguf
from pagellm.platforms.cpu import CpuPlatform
from pagellm.server import harmony
from pagellm.server.app import build_app
from pagellm.server.protocol import ChatCompletionRequest
from pagellm.server.serving_chat import ServingChat
from pagellm.server.serving_models import ServedModels
from pagellm.server.tool_parsers import OpenAIToolParser

ATOL = 1e-4
PROMPT = [5, 77, 200, 13, 150, 42, 99, 260, 301, 7, 64, 120, 33]  # longer than the 8-token window


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_tiny_checkpoint("gpt_oss", tmp_path_factory.mktemp("gpt_oss"))


def assert_logits_match(path: Path, platform: type[Platform] = Platform) -> None:
    """Logits against transformers' through prefill and four decode steps; MXFP4 experts placed by
    `platform` as the engine does (the base platform has no MXFP4 kernel: they are dequantized)."""
    reference = load_reference(path)
    model = load_pagellm(path)
    place_mxfp4_experts(model, platform)
    runner = PagedRunner(model, num_seqs=1)
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


@pytest.fixture(scope="module")
def mxfp4_checkpoint(tmp_path_factory) -> Path:
    path = make_tiny_checkpoint("gpt_oss", tmp_path_factory.mktemp("gpt_oss_mxfp4"))
    write_mxfp4_experts(path)
    return path


def test_mxfp4_experts_dequantized_match_transformers(mxfp4_checkpoint):
    """transformers reads the pairs with its own dequantization (on a CPU it dequantizes instead of
    running MXFP4 kernels); a platform without an MXFP4 kernel dequantizes them the same way."""
    assert_logits_match(mxfp4_checkpoint)


@pytest.mark.skipif(not cpu_gguf.available(), reason="the native CPU kernels are not built here")
def test_mxfp4_experts_kept_packed_on_cpu(mxfp4_checkpoint):
    """On the CPU the experts stay the checkpoint's MXFP4 bytes (GGML's block order) on the GGUF experts
    kernel, biases and the clamped SwiGLU in it: logits as transformers' to float32 rounding, greedy tokens
    identical through the engine (batching, chunked prefill), the experts' memory the checkpoint's blocks
    and scales exactly; in bfloat16 (int8 x) the drift from float32 is printed."""
    assert_logits_match(mxfp4_checkpoint, CpuPlatform)

    llm = LLM(str(mxfp4_checkpoint), dtype="float32", num_kv_blocks=64, max_model_len=256)
    assert llm.engine.setup.quant_method is None  # the model reads the format; no method is selected
    layers = [m for m in llm.engine.runner.model.modules() if isinstance(m, FusedMoE)]
    assert layers and all("MXFP4" in layer.packed.description for layer in layers)
    state = load_file(str(mxfp4_checkpoint / "model.safetensors"))
    checkpoint_bytes = sum(t.numel() for n, t in state.items() if n.endswith(("_blocks", "_scales")))
    kept = sum(t.numel() * t.element_size() for layer in layers for t in layer.packed.run.blocks)
    assert kept == checkpoint_bytes
    assert_greedy_parity(llm, Reference(mxfp4_checkpoint, 8), mixed_prompts(300)[:4])

    # bfloat16: int8 activations on the packed experts against the same model's experts dequantized to
    # bfloat16 (the tiny random model drifts a lot in bfloat16 either way)
    reference = reference_logits(load_reference(mxfp4_checkpoint), PROMPT)[-1].log_softmax(-1)
    top = reference.topk(8).indices
    drift = {}
    for name, platform in [("packed", CpuPlatform), ("dequantized", Platform)]:
        model = load_pagellm(mxfp4_checkpoint, dtype=torch.bfloat16)
        place_mxfp4_experts(model, platform)
        logits = PagedRunner(model, num_seqs=1).step({0: PROMPT})[0][-1].float().log_softmax(-1)
        drift[name] = float((logits[top] - reference[top]).abs().max())
    print(
        f"MXFP4 experts in bfloat16, top-8 log-prob drift from float32: packed (int8 activations) "
        f"{drift['packed']:.4f}, dequantized to bfloat16 {drift['dequantized']:.4f}"
    )
    assert drift["packed"] < max(2 * drift["dequantized"], 0.05)


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


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "weather",
            "description": "Weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


def test_harmony_tool_turns_and_parsers_through_the_server(checkpoint):
    """`--reasoning-parser openai_gptoss --tool-call-parser openai`: an earlier call and its result render
    through the GPT-OSS template (the reasoning sent back as `thinking`, the arguments as JSON); the
    parsers read the reply with its special tokens, streamed as whole. A random model speaks no harmony,
    so its marker tokens are favoured and the reply is compared with the parsers' reading of the same text
    from /v1/completions with special tokens kept; a realistic reply goes through the server's parse."""
    llm = AsyncLLM(
        str(checkpoint), dtype="float32", num_kv_blocks=128, max_model_len=512, engine_process=False,
        reasoning_parser="openai_gptoss",
    )  # fmt: skip
    options = {"tool_call_parser": "openai", "enable_auto_tool_choice": True}
    app = build_app(llm, ["tiny"], log_requests=False, **options)
    chat = ServingChat(llm, ServedModels(llm, ["tiny"]), **options)
    tokenizer = llm.tokenizer
    messages = [
        {"role": "user", "content": "Paris?"},
        {"role": "assistant", "content": None, "reasoning": "Look it up.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}},
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]  # fmt: skip
    ids = chat.chat_prompt_ids(ChatCompletionRequest(messages=messages).messages, None, True, TOOLS)
    prompt = tokenizer.decode(ids, skip_special_tokens=False)
    assert "namespace functions {\n\n// Weather\ntype weather = (_: {" in prompt
    assert prompt.endswith(
        "<|start|>assistant<|channel|>analysis<|message|>Look it up.<|end|>"
        '<|start|>assistant to=functions.weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>'
        "<|start|>functions.weather to=assistant<|channel|>commentary<|message|>sunny<|end|><|start|>assistant"
    )

    markers = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>")
    bias = {str(tokenizer.convert_tokens_to_ids(m)): 6 for m in markers}
    body = {"model": "tiny", "messages": messages, "tools": TOOLS, "max_tokens": 16, "temperature": 0}

    async def work(client, http):
        whole = (await client.chat.completions.create(**body, logit_bias=bias)).choices[0]
        chunks = [c async for c in await client.chat.completions.create(**body, logit_bias=bias, stream=True)]
        completion = {"prompt": ids, "max_tokens": 16, "temperature": 0, "logit_bias": bias}
        raw = await http.post("/v1/completions", json={**completion, "skip_special_tokens": False})
        return whole, chunks, raw.json()["choices"][0]["text"]

    try:
        whole, chunks, text = call_app(app, work)
    finally:
        llm.shutdown()
    assert any(m in text for m in markers)
    expected = chat.message(text, OpenAIToolParser(), "x")
    reasoning = whole.message.model_extra.get("reasoning")
    assert (whole.message.content, reasoning) == (expected.content, expected.reasoning)
    assert [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or []] == [
        (c.function.name, c.function.arguments) for c in expected.tool_calls
    ]
    assert not any(m in (whole.message.content or "") + (reasoning or "") for m in harmony.MARKERS)
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in deltas) == (whole.message.content or "")
    assert "".join(d.model_extra.get("reasoning") or "" for d in deltas) == (reasoning or "")

    reply = (
        "<|channel|>analysis<|message|>Look it up.<|end|><|start|>assistant<|channel|>commentary "
        'to=functions.weather <|constrain|>json<|message|>{"city": "Paris"}'
    )
    message = chat.message(reply, OpenAIToolParser(), "x")
    assert (message.content, message.reasoning) == (None, "Look it up.")
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == [
        ("weather", '{"city": "Paris"}')
    ]
