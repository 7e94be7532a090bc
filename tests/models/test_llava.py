"""LLaVA against transformers' `LlavaForConditionalGeneration` on tiny random checkpoints, float32: the
image embeddings (vision tower + projector) of CLIP and SigLIP towers with one or several feature layers
and either feature strategy, and the logits of prompts with images through the paged harness (whole, and
with an image split between two steps beside a text-only sequence), from each checkpoint layout LLaVA
checkpoints come in. The engine's side (processor, encoder cache, `LLM.generate` with images) is tested
with the engine."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import transformers
from models_harness import PagedRunner, load_pagellm
from safetensors.torch import load_file, save_file
from session_device import session_device
from tiny import randomise_vectors, tiny_config

from pagellm.core.errors import ConfigError
from pagellm.engine.setup import check_parallel
from pagellm.models.context import ImageBatch
from pagellm.models.llava import LlavaForConditionalGeneration

ATOL = 1e-4
VOCAB = 400
IMAGE = 399  # the placeholder's id
_TOWER = dict(patch_size=14, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)
TOWERS = {
    "clip": dict(_TOWER, model_type="clip_vision_model", image_size=28),  # 2 x 2 patches and the class row
    "siglip": dict(_TOWER, model_type="siglip_vision_model", image_size=42),  # 3 x 3 patches
}

# tower, vision_feature_layer, vision_feature_select_strategy, other config fields
EMBEDDING_CASES = {
    "clip-2-default": ("clip", -2, "default", {}),
    # hidden state 0 (the embeddings after the pre-layernorm) and the last layer's output
    "clip-list-full": ("clip", [0, -1], "full", {}),
    "siglip-2-full-tanh-no-bias": (
        "siglip",
        -2,
        "full",
        dict(projector_hidden_act="gelu_pytorch_tanh", multimodal_projector_bias=False),
    ),
    # the last layer's output without the tower's post-layernorm
    "siglip-list-default": ("siglip", [1, -1], "default", {}),
}


def make_llava(path: Path, tower: str, feature_layer, strategy: str, text: str = "llama", **fields):
    """A tiny random LLaVA saved at `path`, and the transformers model itself (the reference)."""
    config = transformers.LlavaConfig(
        text_config=tiny_config(text, vocab_size=VOCAB).to_dict(),
        vision_config=TOWERS[tower],
        image_token_id=IMAGE,
        vision_feature_layer=feature_layer,
        vision_feature_select_strategy=strategy,
        **fields,
    )
    torch.manual_seed(0)
    model = transformers.LlavaForConditionalGeneration(config)
    randomise_vectors(model)
    model.save_pretrained(path)
    return model.to(session_device()).eval()


def pixels(tower: str, count: int) -> torch.Tensor:
    size = TOWERS[tower]["image_size"]
    return torch.randn(count, 3, size, size, generator=torch.Generator().manual_seed(1)).to(session_device())


def encode(model, pixel_values: torch.Tensor) -> list[torch.Tensor]:
    with torch.no_grad():
        return model.encode_images([{"pixel_values": p.unsqueeze(0)} for p in pixel_values])


@pytest.mark.parametrize("case", list(EMBEDDING_CASES))
def test_image_embeddings_match_transformers(case, tmp_path):
    tower, feature_layer, strategy, fields = EMBEDDING_CASES[case]
    reference = make_llava(tmp_path, tower, feature_layer, strategy, **fields)
    model = load_pagellm(tmp_path)
    images = pixels(tower, 2)
    with torch.no_grad():
        expected = reference.get_image_features(pixel_values=images).pooler_output
    got = encode(model, images)
    assert len(got) == 2
    for g, e in zip(got, expected, strict=True):
        assert g.shape == e.shape
        torch.testing.assert_close(g, e, atol=ATOL, rtol=0)
    # every image its own embeddings: the batch does not mix images
    torch.testing.assert_close(encode(model, images[1:])[0], got[1], atol=ATOL, rtol=0)


def prompt_with_images(rows: int) -> list[int]:
    """Text, an image's placeholders, text, another image's, text."""
    return [1, 17, 230, *[IMAGE] * rows, 45, 88, 9, *[IMAGE] * rows, 301, 64, 120, 33]


def image_rows(ids: list[int], start: int, end: int, embeds: torch.Tensor, flat_offset: int) -> ImageBatch:
    """The ImageBatch of prompt positions [start, end) run at flat rows from `flat_offset`: `embeds` holds
    every placeholder's embedding in prompt order."""
    places = [p for p, token in enumerate(ids) if token == IMAGE]
    chosen = [i for i, p in enumerate(places) if start <= p < end]
    rows = torch.tensor([flat_offset + places[i] - start for i in chosen], device=embeds.device)
    return ImageBatch(rows, embeds[chosen])


@torch.no_grad()
def reference_logits(reference, ids: list[int], pixel_values: torch.Tensor | None = None) -> torch.Tensor:
    input_ids = torch.tensor([ids], device=reference.device)
    return reference(input_ids=input_ids, pixel_values=pixel_values).logits[0]


@pytest.mark.parametrize(
    ("tower", "text", "strategy", "fields"),
    [
        ("clip", "llama", "default", {}),
        ("siglip", "mistral", "full", {}),
        # tied by the top-level flag alone, as transformers reads it
        ("clip", "qwen2", "full", dict(tie_word_embeddings=True)),
    ],
    ids=["clip-llama", "siglip-mistral", "clip-qwen2-tied"],
)
def test_prompt_with_images_matches_transformers(tower, text, strategy, fields, tmp_path):
    reference = make_llava(tmp_path, tower, -2, strategy, text=text, **fields)
    model = load_pagellm(tmp_path)
    images = pixels(tower, 2)
    embeds = torch.cat(encode(model, images))
    ids = prompt_with_images(embeds.shape[0] // 2)
    expected = reference_logits(reference, ids, images)

    got = PagedRunner(model, num_seqs=1).step({0: ids}, image_rows(ids, 0, len(ids), embeds, 0))[0]
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)

    # the first image split between two steps, the first step batched after a text-only sequence
    text_ids = [1, 5, 77, 200, 13, 150]
    split = ids.index(IMAGE) + 2
    runner = PagedRunner(model, num_seqs=2)
    first = runner.step({0: ids[:split], 1: text_ids}, image_rows(ids, 0, split, embeds, 0))
    second = runner.step({0: ids[split:]}, image_rows(ids, split, len(ids), embeds, 0))[0]
    torch.testing.assert_close(torch.cat([first[0], second]), expected, atol=ATOL, rtol=0)
    torch.testing.assert_close(first[1], reference_logits(reference, text_ids), atol=ATOL, rtol=0)


LAYOUTS = {
    # llava-hf's checkpoints as first published: transformers 5's saved layout, the tower under vision_model.
    "original": (("vision_tower.", "vision_tower.vision_model."),),
    "transformers 4.52": (
        ("language_model.model.", "model.language_model."),
        ("language_model.lm_head.", "lm_head."),
        ("vision_tower.", "model.vision_tower.vision_model."),
        ("multi_modal_projector.", "model.multi_modal_projector."),
    ),
}


def test_each_checkpoint_layout_loads(tmp_path):
    saved = tmp_path / "saved"
    reference = make_llava(saved, "clip", -2, "default")
    state = load_file(saved / "model.safetensors")
    assert any(name.startswith("vision_tower.encoder.") for name in state)  # transformers 5's own layout
    images = pixels("clip", 2)
    for layout, renames in LAYOUTS.items():
        renamed = tmp_path / layout
        shutil.copytree(saved, renamed)
        save_file({_renamed(name, renames): t for name, t in state.items()}, renamed / "model.safetensors")
        model = load_pagellm(renamed)
        embeds = torch.cat(encode(model, images))
        ids = prompt_with_images(embeds.shape[0] // 2)
        got = PagedRunner(model, num_seqs=1).step({0: ids}, image_rows(ids, 0, len(ids), embeds, 0))[0]
        torch.testing.assert_close(got, reference_logits(reference, ids, images), atol=ATOL, rtol=0)


def _renamed(name: str, renames: tuple[tuple[str, str], ...]) -> str:
    for prefix, theirs in renames:
        if name.startswith(prefix):
            return theirs + name[len(prefix) :]
    return name


def test_the_layers_past_the_feature_layer_are_not_built(tmp_path):
    make_llava(tmp_path, "siglip", -2, "full")
    tower = load_pagellm(tmp_path).vision_tower
    assert len(tower.encoder.layers) == 1
    assert not any(name.startswith(("post_layernorm", "head")) for name, _ in tower.named_parameters())
    assert json.loads((tmp_path / "config.json").read_text())["vision_config"]["num_hidden_layers"] == 2


def test_tensor_and_pipeline_parallelism_are_refused():
    for tp, pp in ((2, 1), (1, 2)):
        config = SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp, data_parallel_size=1)
        with pytest.raises(ConfigError, match="LlavaForConditionalGeneration does not support tensor"):
            check_parallel(config, tiny_config("llama", vocab_size=VOCAB), LlavaForConditionalGeneration)
