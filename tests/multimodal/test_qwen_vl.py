"""Qwen2.5-VL through the engine against transformers, in float32, token for token: a tiny model (a vision
encoder with a window-attention block and a full-attention one, a Qwen2 decoder with the multimodal rope)
with its own image processor; images of different sizes (different grids, so different windows and
positions), several per prompt, batched with a text-only prompt, cut across steps by chunked prefill,
preempted mid-image; the encoder and the three-axis positions against transformers' own functions."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from tiny_qwen_vl import IMAGE, make_tiny_qwen2_5_vl, processor
from tiny_vlm import greedy_reference

from pagellm import LLM, SamplingParams
from pagellm.models.qwen_vl import Qwen2_5_VLForConditionalGeneration
from pagellm.multimodal.inputs import ImageInput

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)


def picture(height: int, width: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


# 16 image tokens (4 x 4 merged patches: four windows), 6 (2 x 3: a window of 2 x 2 and one of 2 x 1), 4
BIG, WIDE, SMALL = picture(112, 112, 1), picture(56, 84, 2), picture(56, 56, 3)
PROMPTS = [
    (f"a photo {IMAGE} of what", [BIG]),
    (f"two {IMAGE} and {IMAGE} compared, the first one is", [WIDE, SMALL]),
    ("just some text with no image at all", []),
    (f"{IMAGE} begins the prompt", [WIDE]),
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_qwen2_5_vl(tmp_path_factory.mktemp("qwen2_5_vl"))


@pytest.fixture(scope="module")
def hf(checkpoint):
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(checkpoint, dtype=torch.float32).eval()
    return model, processor(checkpoint)


@pytest.fixture(scope="module")
def reference(hf):
    return greedy_reference(*hf, MAX_TOKENS)


def run(llm: LLM, prompts: list[tuple[str, list]]) -> list[list[int]]:
    requests = [{"prompt": t, "multi_modal_data": {"image": p}} if p else {"prompt": t} for t, p in prompts]
    return [o.outputs[0].token_ids for o in llm.generate(requests, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def llm(checkpoint):
    """A 10-token budget cuts the 16-token image across steps; 5 KV blocks of 16 force preemptions. No
    limit_mm_per_prompt: two images per prompt are within the default (999, vLLM's)."""
    return LLM(
        str(checkpoint),
        dtype="float32",
        max_model_len=64,
        num_kv_blocks=5,
        block_size=16,
        max_num_batched_tokens=10,
        max_num_seqs=3,
    )


def test_encoder_and_positions_equal_transformers(hf, llm):
    """encode_images against get_image_features, mrope_positions against get_rope_index, for a prompt with
    two images of different grids (one cut into windows)."""
    model, proc = hf
    config = model.config
    inputs = proc(text=[f"two {IMAGE} and {IMAGE} then"], images=[BIG, WIDE], return_tensors="pt")
    token_ids = inputs["input_ids"][0].tolist()
    placed = Qwen2_5_VLForConditionalGeneration.image_inputs(config, inputs, token_ids)
    assert [length for _, length, _ in placed] == [16, 6]
    with torch.no_grad():
        expected = model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"])
        got = llm.engine.runner.model.encode_images([data for _, _, data in placed])
    for a, b in zip(got, expected.pooler_output, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    images = [ImageInput(offset, length, "", data) for offset, length, data in placed]
    positions, delta = Qwen2_5_VLForConditionalGeneration.mrope_positions(config, token_ids, images)
    want, want_delta = model.model.get_rope_index(
        inputs["input_ids"], inputs["mm_token_type_ids"], inputs["image_grid_thw"]
    )
    assert torch.equal(positions, want[:, 0]) and delta == int(want_delta) < 0


def test_images_match_transformers_batched_chunked_and_preempted(llm, reference):
    """Every prompt at once, chunked and preempted; the tokens generated after an image run at their
    position plus the prompt's (negative) delta."""
    assert run(llm, PROMPTS) == [reference(t, p) for t, p in PROMPTS]
    assert llm.engine.stats().num_preemptions > 0
    assert not llm.engine.runner.encoder_cache.outputs


def test_chat_with_an_image_part_equals_the_rendered_prompt(llm, reference):
    """The chat template writes the vision tokens for an image part; the processor expands the pad."""
    messages = [
        {
            "role": "user",
            "content": [{"type": "image_pil", "image_pil": WIDE}, {"type": "text", "text": "what is this"}],
        }
    ]
    (out,) = llm.chat(messages, GREEDY, use_tqdm=False)
    text = f"<|im_start|>user\n{IMAGE}what is this<|im_end|>\n<|im_start|>assistant\n"
    assert out.outputs[0].token_ids == reference(text, [WIDE])


def test_a_chat_with_two_images_runs_under_the_default_limit(llm, reference):
    """Two image parts in one message, with limit_mm_per_prompt left at its default."""
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image_pil", "image_pil": WIDE},
                {"type": "image_pil", "image_pil": SMALL},
                {"type": "text", "text": "compare"},
            ],
        }
    ]
    (out,) = llm.chat(messages, GREEDY, use_tqdm=False)
    text = f"<|im_start|>user\n{IMAGE}{IMAGE}compare<|im_end|>\n<|im_start|>assistant\n"
    assert out.outputs[0].token_ids == reference(text, [WIDE, SMALL])
