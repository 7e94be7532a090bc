"""Images through the engine against transformers, in float32, token for token: a tiny LLaVA (CLIP tower,
Llama decoder) with its own processor; one and several images per prompt batched with text-only prompts,
chunked prefill that cuts an image's tokens across steps (encoded once), preemption mid-image, prefix-cache
hits keyed by the image's content (the same image again hits; another image under the same text does not),
LLM.chat with image parts, and the refusals."""

from __future__ import annotations

import base64
import io

import pytest
import torch
from tiny_vlm import IMAGE_TOKEN, greedy_reference, images, make_tiny_llava

from pagellm import LLM, SamplingParams
from pagellm.core.errors import ConfigError

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    return make_tiny_llava(tmp_path_factory.mktemp("llava"))


@pytest.fixture(scope="module")
def reference(llava):
    """transformers' greedy generate on the checkpoint's own processor output, one prompt at a time."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model = AutoModelForImageTextToText.from_pretrained(llava, dtype=torch.float32).eval()
    return greedy_reference(model, AutoProcessor.from_pretrained(llava), MAX_TOKENS)


def prompt(text: str, pictures: list) -> dict:
    return {"prompt": text, "multi_modal_data": {"image": pictures}} if pictures else {"prompt": text}


def run(llm: LLM, prompts: list[tuple[str, list]]) -> list[list[int]]:
    outputs = llm.generate([prompt(t, p) for t, p in prompts], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


PICTURES = images(3, seed=1)
PROMPTS = [
    (f"a photo {IMAGE_TOKEN} of what", PICTURES[:1]),
    (f"two {IMAGE_TOKEN} and {IMAGE_TOKEN} compared, the first one is", PICTURES[1:3]),
    ("just some text with no image at all", []),
    (f"{IMAGE_TOKEN} begins the prompt", PICTURES[2:3]),
]


def test_images_match_transformers_batched_chunked_and_preempted(llava, reference):
    """A 12-token budget cuts every 16-token image across steps; 6 KV blocks of 16 force preemptions."""
    llm = LLM(
        str(llava),
        dtype="float32",
        max_model_len=80,
        num_kv_blocks=6,
        block_size=16,
        max_num_batched_tokens=12,
        max_num_seqs=4,
        limit_mm_per_prompt='{"image": 2}',
    )
    assert run(llm, PROMPTS) == [reference(t, p) for t, p in PROMPTS]
    assert llm.engine.stats().num_preemptions > 0
    assert not llm.engine.runner.encoder_cache.outputs  # every image's output freed after its last token


def test_the_prefix_cache_keys_images_by_content(llava, reference):
    """The same image under the same text again is a hit; a different image under the same text is not
    (the placeholder tokens are the same, so a cache keyed by tokens alone would serve the first image's KV)."""
    llm = LLM(str(llava), dtype="float32", max_model_len=96, num_kv_blocks=64, block_size=16)
    text = f"describe {IMAGE_TOKEN} in detail please, and then tell me more about it"
    first = run(llm, [(text, PICTURES[:1])])
    hits = llm.engine.stats().prefix_cache_hits
    assert run(llm, [(text, PICTURES[:1])]) == first
    assert llm.engine.stats().prefix_cache_hits > hits
    hits = llm.engine.stats().prefix_cache_hits
    assert run(llm, [(text, PICTURES[1:2])]) == [reference(text, PICTURES[1:2])]
    assert llm.engine.stats().prefix_cache_hits == hits  # block 0 holds image tokens: nothing to reuse


def test_chat_with_image_parts_equals_the_rendered_prompt(llava, reference):
    llm = LLM(str(llava), dtype="float32", max_model_len=96, num_kv_blocks=64)
    buffer = io.BytesIO()
    PICTURES[0].save(buffer, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "what is"},
                {"type": "image_url", "image_url": {"url": url}},
            ],
        }
    ]
    (out,) = llm.chat(messages, GREEDY, use_tqdm=False)
    text = f"<|im_start|>user\nwhat is{IMAGE_TOKEN}<|im_end|>\n<|im_start|>assistant\n"
    assert out.outputs[0].token_ids == reference(text, PICTURES[:1])
    (pil,) = llm.chat(
        [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "what is"},
                    {"type": "image_pil", "image_pil": PICTURES[0]},
                ],
            }
        ],
        GREEDY,
        use_tqdm=False,
    )
    assert pil.outputs[0].token_ids == out.outputs[0].token_ids


def test_bad_image_inputs_are_refused_and_nothing_is_queued(llava, tiny_text_model):
    llm = LLM(
        str(llava), dtype="float32", max_model_len=96, num_kv_blocks=64, limit_mm_per_prompt='{"image": 1}'
    )
    with pytest.raises(ConfigError, match="at most 1"):
        llm.generate([prompt(f"{IMAGE_TOKEN}{IMAGE_TOKEN}", PICTURES[:2])], GREEDY, use_tqdm=False)
    with pytest.raises(ConfigError, match="do not match|placeholders"):
        llm.generate([prompt("no placeholder here", PICTURES[:1])], GREEDY, use_tqdm=False)
    with pytest.raises(ConfigError, match="PIL image"):
        llm.generate([prompt(IMAGE_TOKEN, [b"not an image"])], GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    text_only = LLM(str(tiny_text_model), dtype="float32", max_model_len=64, num_kv_blocks=16)
    with pytest.raises(ConfigError, match="takes no images"):
        text_only.generate([prompt("hi", PICTURES[:1])], GREEDY, use_tqdm=False)


@pytest.fixture(scope="module")
def tiny_text_model(tmp_path_factory):
    from tiny import make_tiny_checkpoint

    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("text"))


def test_a_steps_three_axis_positions_come_from_the_prompts_table_then_the_delta():
    """Qwen-VL's rope: prompt tokens take their [3, P] table's columns, later tokens p + delta on every axis,
    a request without a table its plain positions, whatever the chunk."""
    from types import SimpleNamespace

    import numpy as np

    from pagellm.worker.input_batch import mrope_positions

    table = np.array([[0, 1, 1, 1, 2], [0, 1, 1, 2, 2], [0, 1, 2, 1, 2]])  # 5 prompt tokens
    with_image = SimpleNamespace(mrope_positions=table, mrope_delta=-2)
    text = SimpleNamespace(mrope_positions=None, mrope_delta=0)
    positions = np.array([3, 4, 5, 6, 7, 8])  # the first request's tokens 3..6, the second's 7..8
    cu = np.array([0, 4, 6])
    out = mrope_positions([with_image, text], positions, cu)
    assert out.tolist() == [[1, 2, 3, 4, 7, 8], [2, 2, 3, 4, 7, 8], [1, 2, 3, 4, 7, 8]]


def test_a_chat_template_shipped_only_for_the_processor_is_used(tmp_path):
    """LLaVA 1.5's layout: the template in chat_template.json, which tokenizers do not read."""
    import json

    path = make_tiny_llava(tmp_path / "legacy")
    template = (path / "chat_template.jinja").read_text()
    (path / "chat_template.jinja").unlink()
    (path / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    llm = LLM(str(path), dtype="float32", max_model_len=96, num_kv_blocks=64)
    messages = [{"role": "user", "content": [{"type": "image_pil", "image_pil": PICTURES[0]}]}]
    (out,) = llm.chat(messages, GREEDY, use_tqdm=False)
    assert len(out.prompt_token_ids) > 16  # rendered with the image placeholder, expanded


@pytest.mark.slow
def test_the_image_encoder_is_compiled_where_the_text_model_is(llava, reference, caplog):
    import logging

    with caplog.at_level(logging.WARNING, logger="pagellm"):
        llm = LLM(
            str(llava),
            dtype="float32",
            max_model_len=96,
            num_kv_blocks=64,
            enforce_eager=False,
            limit_mm_per_prompt={"image": 2},
        )
        encoder = llm.engine.runner.encoder_cache
        assert encoder.encode != llm.engine.runner.model.encode_images
        assert run(llm, PROMPTS[:2]) == [reference(t, p) for t, p in PROMPTS[:2]]
    assert "failed" not in caplog.text
    assert encoder.encode != llm.engine.runner.model.encode_images  # still the compiled one
