"""Gemma 4 with images against transformers, in float32: a tiny `Gemma4ForConditionalGeneration` with its
processor's files (tests/models/tiny_gemma4_mm.py), 64 tokens per image, whose image tokens attend to each
other both ways on the sliding layers (windows of 16) and causally on the full ones. The image embeddings
equal `get_image_features`'; greedy tokens equal transformers' through the engine with one and two images per
prompt batched with a text-only prompt, then (slow) under a small token budget that stops a prefill chunk
before an image, with preemption, after a prefix-cache hit inside an image and on FLEX_ATTENTION; audio and
video are refused."""

from __future__ import annotations

import pytest
import torch
from models_harness import load_pagellm
from test_gemma3_mm import GREEDY, MAX_TOKENS, prompt, record_chunks, run
from tiny_gemma4_mm import AUDIO, IMAGE, make_tiny_gemma4_mm
from tiny_vlm import greedy_reference, images

from pagellm import LLM
from pagellm.core.errors import ConfigError
from pagellm.models.gemma4_mm import Gemma4ForConditionalGeneration

PICTURES = images(3, seed=1)
WIDE = images(1, seed=4)[0].resize((80, 40))  # 2:1: a grid of 33 x 15 patches, 55 tokens
PROMPTS = [
    (f"a photo {IMAGE} of what", PICTURES[:1]),
    (f"two {IMAGE} and {IMAGE} compared, the first one is", [PICTURES[1], WIDE]),
    ("just some text with no image at all", []),
    (f"{IMAGE} begins the prompt", PICTURES[2:3]),
]


@pytest.fixture(scope="module")
def gemma4(tmp_path_factory):
    return make_tiny_gemma4_mm(tmp_path_factory.mktemp("gemma4mm"))


@pytest.fixture(scope="module")
def hf_model(gemma4):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(gemma4, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def processor(gemma4):
    """pagellm's (transformers' Gemma4Processor for images alone: its video processor needs torchvision)."""
    return Gemma4ForConditionalGeneration.load_processor(str(gemma4))


@pytest.fixture(scope="module")
def reference(hf_model, processor):
    """transformers' greedy generate on the processor's output, one prompt at a time."""
    return greedy_reference(hf_model, processor, MAX_TOKENS)


@pytest.fixture(scope="module")
def causal_reference(hf_model, processor):
    """The same without the token types, so transformers masks the images causally like text."""

    def without_types(**kwargs):
        inputs = processor(**kwargs)
        inputs.pop("mm_token_type_ids")
        return inputs

    return greedy_reference(hf_model, without_types, MAX_TOKENS)


def engine(path, **kwargs) -> LLM:
    settings = dict(dtype="float32", max_model_len=192, num_kv_blocks=128, max_num_seqs=4)
    return LLM(str(path), limit_mm_per_prompt='{"image": 2}', **(settings | kwargs))


def test_image_embeddings_match_get_image_features(gemma4, hf_model, processor):
    """Two images of other shapes in one batch: padded patches, the 2-D rope and the pooling by position."""
    model = load_pagellm(gemma4)
    inputs = processor(text=[f"{IMAGE} {IMAGE}"], images=[PICTURES[0], WIDE], return_tensors="pt")
    with torch.no_grad():
        expected = hf_model.model.get_image_features(
            inputs["pixel_values"], inputs["image_position_ids"], return_dict=True
        ).pooler_output
        per_image = Gemma4ForConditionalGeneration.image_inputs(
            hf_model.config, inputs, inputs["input_ids"][0].tolist()
        )
        ours = model.encode_images([data for _, _, data in per_image])
    assert [e.shape[0] for e in expected] == [length for _, length, _ in per_image] == [64, 55]
    for got, want in zip(ours, expected, strict=True):
        torch.testing.assert_close(got, want)


def test_images_match_transformers_batched(gemma4, reference, causal_reference):
    """The default backend choice skips CPU_ATTN (its kernel is causal only)."""
    llm = engine(gemma4)
    assert llm.engine.setup.backend.name == "TORCH_SDPA"
    expected = [reference(t, p) for t, p in PROMPTS]
    assert run(llm, PROMPTS) == expected
    # the image mask matters here: a causal one gives other tokens
    assert any(causal_reference(t, p) != e for (t, p), e in zip(PROMPTS, expected, strict=True))
    with pytest.raises(ConfigError, match="image"):
        llm.generate([{"prompt": "hi", "multi_modal_data": {"audio": b"\0"}}], GREEDY, use_tqdm=False)
    with pytest.raises(ConfigError, match="audio or video"):
        llm.generate([prompt(f"{AUDIO} and {IMAGE}", PICTURES[:1])], GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.slow
def test_chunked_before_an_image_and_preempted(gemma4, reference):
    """A 72-token budget over prompts of 55- and 64-token images: chunks stop before an image and take it
    whole; few KV blocks force preemptions."""
    llm = engine(
        gemma4, max_model_len=160, num_kv_blocks=72, block_size=8, max_num_batched_tokens=72,
        attention_backend="TORCH_SDPA",
    )  # fmt: skip
    chunks = record_chunks(llm)
    assert run(llm, PROMPTS) == [reference(t, p) for t, p in PROMPTS]
    assert llm.engine.stats().num_preemptions > 0
    stopped_short = 0
    for request, first, n in chunks:
        for image in request.images:
            assert not image.offset < first + n < image.end  # no chunk ends inside an image
            stopped_short += first + n == image.offset and n < 72
    assert stopped_short


@pytest.mark.slow
def test_a_prefix_cache_hit_inside_an_image(gemma4, reference):
    """The hit's image tokens were computed with the whole image in view; the rest of it runs after them."""
    llm = engine(gemma4, block_size=8, attention_backend="TORCH_SDPA")
    long, short = f"a photo {IMAGE} of what it shows", f"a photo {IMAGE}"
    run(llm, [(long, PICTURES[:1])])
    hits = llm.engine.stats().prefix_cache_hits
    chunks = record_chunks(llm)
    assert run(llm, [(short, PICTURES[:1])]) == [reference(short, PICTURES[:1])]
    hit = llm.engine.stats().prefix_cache_hits - hits
    (request, first, _), *_ = chunks
    (image,) = request.images
    assert first == hit and image.offset < hit < image.end


@pytest.mark.slow
def test_flex_attention(gemma4, reference):
    llm = engine(gemma4, attention_backend="FLEX_ATTENTION")
    assert run(llm, PROMPTS) == [reference(t, p) for t, p in PROMPTS]
