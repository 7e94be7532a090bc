"""Gemma 3 with images through the engine against transformers, in float32, token for token: a tiny
`Gemma3ForConditionalGeneration` with its own processor (tests/models/tiny_gemma3_mm.py), whose image tokens
attend to each other both ways (sliding-window layers of 8 tokens over images of 16): one and two images per
prompt batched with a text-only prompt, a small token budget that stops a prefill chunk before an image and
runs the image whole, preemption, a prefix-cache hit that ends inside an image; the refusal of an image
longer than the budget; the scheduler's rule on its own."""

from __future__ import annotations

import pytest
import torch
from tiny_gemma3_mm import BOI, make_tiny_gemma3_mm
from tiny_vlm import images

from pagellm import LLM, SamplingParams
from pagellm.core.errors import ConfigError
from pagellm.engine.request import Request
from pagellm.engine.scheduler import Scheduler
from pagellm.multimodal.inputs import ImageInput

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
IMAGE_TOKENS = 16
PICTURES = images(3, seed=1)
PROMPTS = [
    (f"a photo {BOI} of what", PICTURES[:1]),
    (f"two {BOI} and {BOI} compared, the first one is", PICTURES[1:3]),
    ("just some text with no image at all", []),
    (f"{BOI} begins the prompt", PICTURES[2:3]),
]


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    # seed 2: a causal mask over the images gives other tokens for one of the prompts (checked below)
    return make_tiny_gemma3_mm(tmp_path_factory.mktemp("gemma3mm"), seed=2)


@pytest.fixture(scope="module")
def reference(gemma3):
    """transformers' greedy generate on the processor's output, one prompt at a time; `causal=True` leaves
    out the token types, so transformers masks the images causally like text."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model = AutoModelForImageTextToText.from_pretrained(gemma3, dtype=torch.float32).eval()
    processor = AutoProcessor.from_pretrained(gemma3)
    cache = {}

    @torch.no_grad()
    def generate(text: str, pictures: list, causal: bool = False) -> list[int]:
        key = (text, tuple(map(id, pictures)), causal)
        if key not in cache:
            inputs = processor(text=[text], images=pictures or None, return_tensors="pt")
            if causal:
                inputs.pop("token_type_ids", None)
            out = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)
            cache[key] = out[0, inputs["input_ids"].shape[1] :].tolist()
        return cache[key]

    return generate


def prompt(text: str, pictures: list) -> dict:
    return {"prompt": text, "multi_modal_data": {"image": pictures}} if pictures else {"prompt": text}


def run(llm: LLM, prompts: list[tuple[str, list]]) -> list[list[int]]:
    outputs = llm.generate([prompt(t, p) for t, p in prompts], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def record_chunks(llm: LLM) -> list[tuple[Request, int, int]]:
    """(request, first position, tokens) of every chunk the scheduler hands out from now on."""
    scheduler, chunks = llm.engine.scheduler, []
    schedule = scheduler.schedule

    def recording():
        out = schedule()
        chunks.extend(
            (r, r.num_computed_tokens, out.num_scheduled_tokens[r.request_id]) for r in out.scheduled
        )
        return out

    scheduler.schedule = recording
    return chunks


@pytest.mark.parametrize("backend", ["TORCH_SDPA", pytest.param("FLEX_ATTENTION", marks=pytest.mark.slow)])
def test_images_match_transformers_batched(gemma3, reference, backend):
    """The default backend choice skips CPU_ATTN (its kernel is causal only) and says why."""
    auto = backend == "TORCH_SDPA"
    llm = LLM(
        str(gemma3),
        dtype="float32",
        max_model_len=96,
        num_kv_blocks=64,
        max_num_seqs=4,
        limit_mm_per_prompt='{"image": 2}',
        **({} if auto else {"attention_backend": backend}),
    )
    assert llm.engine.setup.backend.name == backend
    if auto:
        assert any("CPU_ATTN" in line and "bidirectional" in line for line in llm.engine.setup.explanation)
    expected = [reference(t, p) for t, p in PROMPTS]
    assert run(llm, PROMPTS) == expected
    # the image mask matters here: a causal one gives other tokens
    assert any(reference(t, p, causal=True) != e for (t, p), e in zip(PROMPTS, expected, strict=True))


def test_a_chunk_stops_before_an_image_and_takes_it_whole_even_preempted(gemma3, reference):
    """A 20-token budget over prompts of 16-token images; 40 KV blocks of 8 over 6 KV cache groups (one
    per window layer) force preemptions."""
    llm = LLM(
        str(gemma3),
        dtype="float32",
        max_model_len=80,
        num_kv_blocks=40,
        block_size=8,
        max_num_batched_tokens=20,
        max_num_seqs=4,
        limit_mm_per_prompt='{"image": 2}',
        attention_backend="TORCH_SDPA",
    )
    chunks = record_chunks(llm)
    assert run(llm, PROMPTS) == [reference(t, p) for t, p in PROMPTS]
    assert llm.engine.stats().num_preemptions > 0
    stopped_short = 0
    for request, start, n in chunks:
        for image in request.images:
            assert not image.offset < start + n < image.end  # no chunk ends inside an image
            if start + n == image.offset and n < 20:
                stopped_short += 1
    assert stopped_short


def test_a_prefix_cache_hit_may_end_inside_an_image(gemma3, reference):
    """The hit's image tokens were computed with the whole image in view; the rest of the image runs
    after them, seeing them and one another."""
    llm = LLM(
        str(gemma3),
        dtype="float32",
        max_model_len=96,
        num_kv_blocks=160,
        block_size=8,
        attention_backend="TORCH_SDPA",
    )
    long, short = f"a photo {BOI} of what it shows", f"a photo {BOI}"
    run(llm, [(long, PICTURES[:1])])
    hits = llm.engine.stats().prefix_cache_hits
    chunks = record_chunks(llm)
    assert run(llm, [(short, PICTURES[:1])]) == [reference(short, PICTURES[:1])]
    hit = llm.engine.stats().prefix_cache_hits - hits
    (request, start, _), *_ = chunks
    (image,) = request.images
    assert start == hit and image.offset < hit < image.end


def test_an_image_longer_than_the_budget_is_refused(gemma3):
    llm = LLM(
        str(gemma3),
        dtype="float32",
        max_model_len=96,
        num_kv_blocks=64,
        max_num_batched_tokens=12,
        max_num_seqs=4,
        attention_backend="TORCH_SDPA",
    )
    with pytest.raises(ConfigError, match=r"image\[0\] takes 16 tokens.*max_num_batched_tokens \(12\)"):
        llm.generate([prompt(f"a photo {BOI}", PICTURES[:1])], GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_the_scheduler_never_cuts_an_image_across_chunks():
    """Images at [10, 26) and [28, 44) of 50 tokens: a 20-token budget stops before the first (10), takes
    it whole and stops before the second (18), takes that whole (20), then the rest; a chunk that would
    start inside an image without room for the rest of it gets nothing."""
    scheduler = Scheduler(
        max_num_seqs=2, max_num_batched_tokens=20, max_model_len=128, block_size=4, num_blocks=64,
        whole_images=True,
    )  # fmt: skip
    request = Request(
        "a",
        list(range(50)),
        SamplingParams(max_tokens=1),
        images=[ImageInput(10, IMAGE_TOKENS, "x", {}), ImageInput(28, IMAGE_TOKENS, "y", {})],
    )
    scheduler.add_request(request)
    counts = []
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        counts.append(out.num_scheduled_tokens["a"])
        scheduler.update_from_output(out, {"a": [7]})
    assert counts == [10, 18, 20, 2]
    assert scheduler._whole_images(request, 20, 5) == 0  # starts inside the first image, 6 of it left
    assert scheduler._whole_images(request, 20, 6) == 6
