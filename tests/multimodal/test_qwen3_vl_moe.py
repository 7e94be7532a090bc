"""Qwen3-VL-MoE against transformers, in float32: a tiny model (Qwen3-VL's vision encoder and deepstack, a
decoder with 8 routed experts of which 2 run, renormalised, and one dense layer by `mlp_only_layers`, an
untied output projection). Its experts load from both layouts transformers reads (its own `save_pretrained`
one and the released checkpoints' transposed one) into the weights transformers holds; through the engine
the released layout gives transformers' tokens and log-probabilities with images of different sizes, two in
one prompt, batched with a text-only prompt, cut across steps by chunked prefill and preempted mid-image."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from test_qwen3_vl import BIG, PROMPTS, SMALL, WIDE, run
from tiny_qwen3_vl import make_tiny_qwen3_vl, processor, with_released_expert_layout
from tiny_qwen_vl import IMAGE

from pagellm import LLM, SamplingParams
from pagellm.core.errors import ConfigError
from pagellm.engine.setup import check_parallel
from pagellm.models.layers.fused_moe.block import SparseMoeBlock
from pagellm.models.llama import LlamaMLP
from pagellm.models.qwen3_vl_moe import Qwen3VLMoeForConditionalGeneration, per_expert_weights

MAX_TOKENS = 8
LOGPROB_ATOL = 1e-4
"""float32 on both sides, the same experts chosen: differences are summation order, ~1e-6."""


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_qwen3_vl(tmp_path_factory.mktemp("qwen3_vl_moe"), moe=True)


@pytest.fixture(scope="module")
def released(checkpoint, tmp_path_factory):
    return with_released_expert_layout(checkpoint, tmp_path_factory.mktemp("released") / "model")


@pytest.fixture(scope="module")
def hf(checkpoint):
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(checkpoint, dtype=torch.float32).eval()
    return model, processor(checkpoint)


def engine(path, **kwargs) -> LLM:
    return LLM(str(path), dtype="float32", max_model_len=64, limit_mm_per_prompt='{"image": 2}', **kwargs)


@pytest.fixture(scope="module")
def llm(released):
    """The released layout; a 10-token budget cuts the 16-token image across steps; 5 KV blocks of 16 force
    preemptions."""
    return engine(released, num_kv_blocks=5, block_size=16, max_num_batched_tokens=10, max_num_seqs=3)


def test_both_expert_layouts_load_as_transformers_loads_them(checkpoint, released, hf):
    """transformers reads both files into the same weights, and so does the model class: experts on layers
    0 and 2 holding transformers' stacked experts, the dense MLP on layer 1, its own output projection; a
    fused expert tensor of neither layout's shape is refused, naming it."""
    from models_harness import load_pagellm
    from transformers import AutoModelForImageTextToText

    model = hf[0]
    other = AutoModelForImageTextToText.from_pretrained(released, dtype=torch.float32)
    theirs = dict(model.named_parameters())
    assert all(torch.equal(p, theirs[n]) for n, p in other.named_parameters())
    for path in (checkpoint, released):
        ours = load_pagellm(path, device="cpu")
        layers = ours.model.layers
        assert [type(layer.mlp) for layer in layers] == [SparseMoeBlock, LlamaMLP, SparseMoeBlock]
        for i in (0, 2):
            prefix = f"model.language_model.layers.{i}.mlp"
            mlp = layers[i].mlp
            assert torch.equal(mlp.experts.w13, theirs[f"{prefix}.experts.gate_up_proj"])
            assert torch.equal(mlp.experts.w2, theirs[f"{prefix}.experts.down_proj"])
            assert torch.equal(mlp.gate.weight, theirs[f"{prefix}.gate.weight"])
        assert torch.equal(ours.lm_head.weight, theirs["lm_head.weight"])
        assert not torch.equal(ours.lm_head.weight, ours.model.embed_tokens.weight)
    text = model.config.text_config
    shape = (text.num_experts, text.hidden_size, text.moe_intermediate_size)
    with pytest.raises(ConfigError, match="experts.down_proj is \\(8, 24, 24\\)"):
        list(per_expert_weights([("m.experts.down_proj", torch.zeros(8, 24, 24))], *shape))


def test_encoder_and_router_equal_transformers(hf, llm):
    """encode_images against get_image_features (the embeddings and each deepstack merger's), and the
    router the engine built: top 2, renormalised, as transformers' always is."""
    model, proc = hf
    ours = llm.engine.runner.model
    for i in (0, 2):
        routing = ours.model.layers[i].mlp.gate.routing
        assert routing.renormalize and routing.top_k == 2 and routing.scoring == "softmax"
    inputs = proc(text=[f"two {IMAGE} and {IMAGE} then"], images=[BIG, WIDE], return_tensors="pt")
    placed = Qwen3VLMoeForConditionalGeneration.image_inputs(
        model.config, inputs, inputs["input_ids"][0].tolist()
    )
    with torch.no_grad():
        expected = model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"])
        got = ours.encode_images([data for _, _, data in placed])
    for i, parts in enumerate(got):
        want = (expected.pooler_output[i], *(layer[i] for layer in expected.deepstack_features))
        assert len(parts) == len(want) == 3
        for a, b in zip(parts, want, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


@torch.no_grad()
def reference(model, proc, text: str, pictures: list) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens and each one's log-probability, for one prompt."""
    inputs = proc(text=[text], images=pictures or None, return_tensors="pt")
    out = model.generate(
        **inputs, max_new_tokens=MAX_TOKENS, do_sample=False, output_scores=True, return_dict_in_generate=True
    )
    tokens = out.sequences[0, inputs["input_ids"].shape[1] :].tolist()
    logprobs = [float(s[0].float().log_softmax(-1)[t]) for s, t in zip(out.scores, tokens, strict=True)]
    return tokens, logprobs


def assert_matches(llm: LLM, hf, prompts) -> None:
    """The engine's greedy tokens are transformers', each with its log-probability within LOGPROB_ATOL."""
    requests = [{"prompt": t, "multi_modal_data": {"image": p}} if p else {"prompt": t} for t, p in prompts]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=0)
    outputs = llm.generate(requests, params, use_tqdm=False)
    for (text, pictures), output in zip(prompts, outputs, strict=True):
        tokens, logprobs = reference(*hf, text, pictures)
        got = output.outputs[0]
        assert got.token_ids == tokens, f"{text!r}: ours {got.token_ids}, transformers {tokens}"
        ours = [lp[t].logprob for lp, t in zip(got.logprobs, tokens, strict=True)]
        torch.testing.assert_close(torch.tensor(ours), torch.tensor(logprobs), rtol=0, atol=LOGPROB_ATOL)


def test_images_match_transformers_batched_chunked_and_preempted(llm, hf):
    """Every prompt at once, chunked (the big image's deepstack rows split across steps) and preempted."""
    assert_matches(llm, hf, PROMPTS)
    assert llm.engine.stats().num_preemptions > 0
    assert not llm.engine.runner.encoder_cache.outputs


@pytest.mark.slow
def test_save_pretrained_layout_matches_transformers_whole_prompts(checkpoint, hf):
    """transformers' own layout through the engine, each prompt in one step, then alone one by one."""
    llm = engine(checkpoint)
    assert_matches(llm, hf, PROMPTS)
    for prompt in ((f"{IMAGE}", [SMALL]), (f"{IMAGE} {IMAGE} twice", [BIG, BIG])):
        assert run(llm, [prompt]) == [reference(*hf, *prompt)[0]]


def test_tensor_and_pipeline_parallelism_are_refused(hf):
    config = hf[0].config
    for tp, pp in ((2, 1), (1, 2)):
        parallel = SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp, data_parallel_size=1)
        with pytest.raises(
            ConfigError, match="Qwen3VLMoeForConditionalGeneration does not support tensor.*visual"
        ):
            check_parallel(parallel, config.text_config, Qwen3VLMoeForConditionalGeneration)
