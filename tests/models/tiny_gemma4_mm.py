"""A tiny Gemma 4 with images (`Gemma4ForConditionalGeneration`) and its processor's files, built in the test:
a random model (the vision encoder with clipped linears and standardised output, its embedder, and the tiny
E2B-like Gemma 4 decoder of tests/models/tiny.py: shared KV, per-layer inputs, K = V full layers), image
tokens attending both ways on the sliding layers (`use_bidirectional_attention` "vision"), a tokenizer
trained here with Gemma 4's image and audio tokens, and the processor's config as a Gemma 4 checkpoint
lays it out (image processor, feature extractor and video processor in processor_config.json). Without
torchvision transformers cannot load that processor (its video processor needs it), so pagellm builds it
for images alone, as the tests' reference does."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tiny import randomise_vectors, tiny_config
from tiny_gemma3_mm import image_tokenizer

BOI, IMAGE, EOI = "<start_of_image>", "<image_soft_token>", "<end_of_image>"
BOA, AUDIO, EOA = "<start_of_audio>", "<audio_soft_token>", "<end_of_audio>"
GEMMA4_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    f"{{% for part in message['content'] %}}{{% if part['type'] == 'image' %}}{IMAGE}"
    "{% else %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
PATCH, KERNEL, MAX_SOFT_TOKENS = 4, 3, 70
"""Patches of 4 pixels, pooled 3 x 3: a square image becomes 96 x 96 pixels, 24 x 24 patches, 64 tokens."""


def make_tiny_gemma4_mm(out: Path, sliding_window: int = 16, seed: int = 0) -> Path:
    """The checkpoint, its tokenizer and processor config in `out`. The sliding layers see
    `sliding_window` tokens, fewer than an image's 64, so the window and the image's span meet."""
    from transformers import (
        Gemma4AudioFeatureExtractor,
        Gemma4Config,
        Gemma4ForConditionalGeneration,
    )
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    tokens = {"boi_token": BOI, "image_token": IMAGE, "eoi_token": EOI}
    tokenizer = image_tokenizer(
        tokens | {"boa_token": BOA, "audio_token": AUDIO, "eoa_token": EOA}, GEMMA4_TEMPLATE
    )
    text = tiny_config(
        "gemma4_text",
        vocab_size=len(tokenizer),
        sliding_window=sliding_window,
        use_bidirectional_attention="vision",
    )
    vision = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=16,
        patch_size=PATCH,
        pooling_kernel_size=KERNEL,
        position_embedding_size=64,
        use_clipped_linears=True,
        standardize=True,
    )
    ids = tokenizer.convert_tokens_to_ids
    config = Gemma4Config(
        text_config=text.to_dict(),
        vision_config=vision,
        audio_config=None,
        image_token_id=ids(IMAGE),
        boi_token_id=ids(BOI),
        eoi_token_id=ids(EOI),
        audio_token_id=ids(AUDIO),
    )
    torch.manual_seed(seed)
    model = Gemma4ForConditionalGeneration(config)
    randomise_vectors(model)
    _spread_vision(model.model)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    image = Gemma4ImageProcessorPil(
        patch_size=PATCH, max_soft_tokens=MAX_SOFT_TOKENS, pooling_kernel_size=KERNEL
    )
    layout = {
        "processor_class": "Gemma4Processor",
        "image_seq_length": MAX_SOFT_TOKENS,
        "image_processor": image.to_dict(),
        "feature_extractor": Gemma4AudioFeatureExtractor().to_dict(),
        "video_processor": {"video_processor_type": "Gemma4VideoProcessor", "patch_size": PATCH},
    }
    (out / "processor_config.json").write_text(json.dumps(layout, indent=2, default=str))
    return out


def _spread_vision(model: torch.nn.Module) -> None:
    """The encoder's position table (ones as initialised), its output statistics and its clipping bounds
    (infinite as initialised) away from their defaults, so each is loaded and used: the bounds cut the
    largest inputs and outputs of every linear map."""
    with torch.no_grad():
        table = model.vision_tower.patch_embedder.position_embedding_table
        table.copy_(torch.randn_like(table) * 0.5)
        model.vision_tower.std_bias.copy_(torch.randn_like(model.vision_tower.std_bias))
        model.vision_tower.std_scale.copy_(1 + torch.rand_like(model.vision_tower.std_scale))
        for name, buffer in model.vision_tower.named_buffers():
            if name.endswith(("input_min", "input_max", "output_min", "output_max")):
                sign = -1.0 if name.endswith("min") else 1.0
                buffer.fill_(sign * (1.5 if "input" in name else 2.0))
