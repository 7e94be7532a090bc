"""Gemma 2 and Gemma 3 (text) against transformers on tiny checkpoints: logits through prefill and decode
across sliding windows, per-layer-type rope with scaling on the global layers, the soft-caps, bf16, and a
chat through `LLM`. Greedy parity through the engine is in tests/engine/test_family_parity.py (FAMILIES)."""

from __future__ import annotations

import pytest
import torch
from models_harness import PagedRunner, load_pagellm, load_reference, reference_logits
from parity import Reference, assert_greedy_parity, mixed_prompts
from tiny import make_tiny_checkpoint

from pagellm import LLM, SamplingParams

ATOL = 1e-4
PROMPT = [5, 77, 200, 13, 150, 42, 99, 260, 301, 7, 64, 120, 33]
WINDOW = {"sliding_window": 5}  # the 13-token prompt and its decode steps cross it
SCALED_GLOBAL_ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
}

VARIANTS = {
    "gemma2": ("gemma2", WINDOW),
    "gemma2-untied-no-soft-caps": (
        "gemma2",
        dict(WINDOW, tie_word_embeddings=False, attn_logit_softcapping=None, final_logit_softcapping=None),
    ),
    "gemma3_text": ("gemma3_text", WINDOW),
    # transformers' Gemma 3 applies a final soft-cap when set and ignores attn_logit_softcapping
    "gemma3_text-scaled-rope-soft-caps": (
        "gemma3_text",
        dict(
            WINDOW,
            rope_parameters=SCALED_GLOBAL_ROPE,
            final_logit_softcapping=5.0,
            attn_logit_softcapping=1.0,
            num_hidden_layers=3,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        ),
    ),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_prefill_and_decode_match_transformers(variant, tmp_path):
    arch, overrides = VARIANTS[variant]
    path = make_tiny_checkpoint(arch, tmp_path, **overrides)
    reference = load_reference(path)
    runner = PagedRunner(load_pagellm(path), num_seqs=1)

    ids = list(PROMPT)
    got = runner.step({0: ids})[0]
    torch.testing.assert_close(got, reference_logits(reference, ids), atol=ATOL, rtol=0)
    for _ in range(4):
        ids.append(int(got[-1].argmax()))
        got = runner.step({0: ids[-1:]})[0]
        torch.testing.assert_close(got[-1], reference_logits(reference, ids)[-1], atol=ATOL, rtol=0)


def test_each_layer_type_gets_its_own_rope(tmp_path):
    """The scaled variant above would pass trivially if the global layers' rope were the local one, or
    unscaled: both change the logits."""
    layers = dict(WINDOW, num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"])
    same = {t: {"rope_type": "default", "rope_theta": 10000.0} for t in SCALED_GLOBAL_ROPE}
    unscaled = dict(SCALED_GLOBAL_ROPE, full_attention={"rope_type": "default", "rope_theta": 1000000.0})
    logits = [
        PagedRunner(
            load_pagellm(make_tiny_checkpoint("gemma3_text", tmp_path / name, **layers, **rope)), 1
        ).step({0: PROMPT})[0]
        for name, rope in [
            ("scaled", {"rope_parameters": SCALED_GLOBAL_ROPE}),
            ("same", {"rope_parameters": same}),
            ("unscaled", {"rope_parameters": unscaled}),
        ]
    ]
    assert (logits[0] - logits[1]).abs().max() > 1e-2
    assert (logits[0] - logits[2]).abs().max() > 1e-2


def test_attention_specs_follow_layer_types(tmp_path):
    from transformers import AutoConfig

    from pagellm.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM

    g2 = AutoConfig.from_pretrained(make_tiny_checkpoint("gemma2", tmp_path))
    specs = [Gemma2ForCausalLM.attention_spec(g2, torch.float32, 16, i) for i in range(4)]
    assert [s.sliding_window for s in specs] == [32, None, 32, None]
    assert {s.logits_soft_cap for s in specs} == {50.0}
    assert {s.softmax_scale for s in specs} == {16**-0.5}  # query_pre_attn_scalar, not head_dim

    g3 = AutoConfig.from_pretrained(
        make_tiny_checkpoint("gemma3_text", tmp_path, attn_logit_softcapping=50.0, query_pre_attn_scalar=256)
    )
    specs = [Gemma3ForCausalLM.attention_spec(g3, torch.float32, 16, i) for i in range(6)]
    assert [s.sliding_window for s in specs] == [32] * 5 + [None]
    assert {s.logits_soft_cap for s in specs} == {None}
    assert {s.softmax_scale for s in specs} == {256**-0.5}


@pytest.mark.parametrize("arch", ["gemma2", "gemma3_text"])
def test_bfloat16_model_stays_close_to_transformers_bfloat16(arch, tmp_path):
    # hidden 48: sqrt(48) = 6.93 is not a bfloat16, so the embedding scale's rounding is transformers'
    path = make_tiny_checkpoint(arch, tmp_path, hidden_size=48, **WINDOW)
    model = load_pagellm(path, torch.bfloat16)
    reference = load_reference(path, torch.bfloat16)
    assert model.model.embed_scale.dtype == torch.bfloat16
    assert (
        model.model.embed_scale.item() == reference.model.embed_tokens.embed_scale.to(torch.bfloat16).item()
    )
    got = PagedRunner(model, num_seqs=1).step({0: PROMPT})[0]
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), reference_logits(reference, PROMPT), atol=0.15, rtol=0)


def test_chat_through_the_engine_matches_transformers(tmp_path):
    path = make_tiny_checkpoint("gemma3_text", tmp_path)
    llm = LLM(str(path), dtype="float32", max_model_len=256)  # KV blocks for 6 groups: sized by the engine
    messages = [{"role": "user", "content": "Hello, how are you today?"}]
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
    tokenizer = llm.get_tokenizer()
    expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert tokenizer.decode(out.prompt_token_ids) == expected
    assert list(out.outputs[0].token_ids) == Reference(path, 8).generate(list(out.prompt_token_ids))


@pytest.mark.slow
def test_lora_adapter_outputs_equal_peft_merged(tmp_path):
    """A PEFT adapter on every projection: greedy outputs equal peft's merge_and_unload() model's."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pagellm import LoRARequest

    base = make_tiny_checkpoint("gemma2", tmp_path)
    torch.manual_seed(0)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    config = LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)
    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), config)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5 / 4)
    peft_model.save_pretrained(tmp_path / "adapter")
    peft_model.merge_and_unload().save_pretrained(tmp_path / "merged")
    AutoTokenizer.from_pretrained(base).save_pretrained(tmp_path / "merged")

    llm = LLM(
        str(base), dtype="float32", num_kv_blocks=200, max_model_len=400, enable_lora=True, max_lora_rank=8
    )
    lora = LoRARequest("a", 1, str(tmp_path / "adapter"))
    prompts = mixed_prompts(300)[:6]

    class WithAdapter:  # assert_greedy_parity with the adapter on every request
        def generate(self, prompts, params, use_tqdm=False):
            return llm.generate(prompts, params, use_tqdm=use_tqdm, lora_request=lora)

    assert_greedy_parity(WithAdapter(), Reference(tmp_path / "merged", 8), prompts)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    few = [{"prompt_token_ids": p} for p in prompts[:3]]

    def tokens(lora_request):
        outputs = llm.generate(few, params, use_tqdm=False, lora_request=lora_request)
        return [o.outputs[0].token_ids for o in outputs]

    assert tokens(lora) != tokens(None)  # the adapter matters
