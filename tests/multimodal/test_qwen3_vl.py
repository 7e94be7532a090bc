"""Qwen3-VL through the engine against transformers, in float32, token for token: a tiny model (a vision
encoder with an interpolated position table and deepstack mergers, a Qwen3 decoder with the interleaved
multimodal rope) with its own image processor; images of different sizes, two in one prompt, batched with
a text-only prompt, cut across steps by chunked prefill, preempted mid-image; the encoder (its embeddings
and the deepstack ones) and the three-axis positions against transformers' own functions."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from tiny_qwen3_vl import make_tiny_qwen3_vl, processor
from tiny_qwen_vl import IMAGE
from tiny_vlm import greedy_reference

from pagellm import LLM, SamplingParams
from pagellm.models.qwen3_vl import Qwen3VLForConditionalGeneration
from pagellm.multimodal.inputs import ImageInput

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)


def picture(height: int, width: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


# 16 image tokens (8 x 8 patches: the 6 x 6 position table stretched), 6 (4 x 6 patches), 4
BIG, WIDE, SMALL = picture(128, 128, 1), picture(64, 96, 2), picture(64, 64, 3)
PROMPTS = [
    (f"a photo {IMAGE} of what", [BIG]),
    (f"two {IMAGE} and {IMAGE} compared, the first one is", [WIDE, SMALL]),
    ("just some text with no image at all", []),
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_qwen3_vl(tmp_path_factory.mktemp("qwen3_vl"))


@pytest.fixture(scope="module")
def hf(checkpoint):
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(checkpoint, dtype=torch.float32).eval()
    return model, processor(checkpoint)


@pytest.fixture(scope="module")
def reference(hf):
    return greedy_reference(*hf, MAX_TOKENS)


@pytest.fixture(scope="module")
def llm(checkpoint):
    """A 10-token budget cuts the 16-token image across steps; 5 KV blocks of 16 force preemptions."""
    return LLM(
        str(checkpoint),
        dtype="float32",
        max_model_len=64,
        num_kv_blocks=5,
        block_size=16,
        max_num_batched_tokens=10,
        max_num_seqs=3,
        limit_mm_per_prompt='{"image": 2}',
    )


def test_encoder_and_positions_equal_transformers(hf, llm):
    """encode_images against get_image_features (the embeddings and each deepstack merger's), and
    mrope_positions against get_rope_index, for a prompt with two images of different grids."""
    model, proc = hf
    config = model.config
    inputs = proc(text=[f"two {IMAGE} and {IMAGE} then"], images=[BIG, WIDE], return_tensors="pt")
    token_ids = inputs["input_ids"][0].tolist()
    placed = Qwen3VLForConditionalGeneration.image_inputs(config, inputs, token_ids)
    assert [length for _, length, _ in placed] == [16, 6]
    with torch.no_grad():
        expected = model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"])
        got = llm.engine.runner.model.encode_images([data for _, _, data in placed])
    assert len(expected.deepstack_features) == 2
    for i, parts in enumerate(got):
        want = (expected.pooler_output[i], *(layer[i] for layer in expected.deepstack_features))
        assert len(parts) == len(want)
        for a, b in zip(parts, want, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    images = [ImageInput(offset, length, "", data) for offset, length, data in placed]
    positions, delta = Qwen3VLForConditionalGeneration.mrope_positions(config, token_ids, images)
    want, want_delta = model.model.get_rope_index(
        inputs["input_ids"], inputs["mm_token_type_ids"], inputs["image_grid_thw"]
    )
    assert torch.equal(positions, want[:, 0]) and delta == int(want_delta) < 0
    engine_model = llm.engine.runner.model
    encoder = {p for m in engine_model.image_encoder_modules() for p in m.parameters()}
    assert encoder == {p for name, p in engine_model.named_parameters() if name.startswith("visual.")}


def test_images_match_transformers_batched_chunked_and_preempted(llm, reference):
    """Every prompt at once, chunked (the big image's deepstack rows split across steps) and preempted."""
    assert run(llm, PROMPTS) == [reference(t, p) for t, p in PROMPTS]
    assert llm.engine.stats().num_preemptions > 0
    assert not llm.engine.runner.encoder_cache.outputs


def run(llm: LLM, prompts: list[tuple[str, list]]) -> list[list[int]]:
    requests = [{"prompt": t, "multi_modal_data": {"image": p}} if p else {"prompt": t} for t, p in prompts]
    return [o.outputs[0].token_ids for o in llm.generate(requests, GREEDY, use_tqdm=False)]
