"""Tiny vision-language checkpoints with their processors, built in the test: a random model of the family,
its image processor with the family's defaults (at a tiny image size), a tokenizer trained here with the
family's special tokens, and a chat template that writes the image placeholder for image parts."""

from __future__ import annotations

from pathlib import Path

import torch
from tiny import SPECIAL_TOKENS, make_tokenizer, tiny_config

IMAGE_TOKEN = "<image>"
# LLaVA's template shape: image parts become the placeholder the processor expands
LLAVA_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}<image>"
    "{% else %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_tiny_llava(out: Path, vision: str = "clip", image_size: int = 56, seed: int = 0) -> Path:
    """A tiny LlavaForConditionalGeneration (CLIP or SigLIP tower, Llama decoder) and its LlavaProcessor
    in `out`: images of `image_size` pixels in patches of 14, so (image_size / 14)^2 image tokens."""
    from transformers import (
        CLIPImageProcessor,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
        SiglipImageProcessor,
    )

    tokenizer = make_tokenizer(384, (*SPECIAL_TOKENS, IMAGE_TOKEN), LLAVA_TEMPLATE)
    image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    text = tiny_config("llama", vocab_size=len(tokenizer))
    tower = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=image_size,
        patch_size=14,
    )
    if vision == "clip":
        vision_config = {"model_type": "clip_vision_model", **tower, "projection_dim": 32}
        image_processor = CLIPImageProcessor(
            size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size}
        )
        strategy = "default"
    else:
        vision_config = {"model_type": "siglip_vision_model", **tower}
        image_processor = SiglipImageProcessor(size={"height": image_size, "width": image_size})
        strategy = "full"
    config = LlavaConfig(
        vision_config=vision_config,
        text_config=text.to_dict(),
        image_token_id=image_token_id,
        vision_feature_select_strategy=strategy,
        vision_feature_layer=-2,
    )
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config)
    with torch.no_grad():  # norms and biases away from their 1/0 initialisation, as trained weights are
        for param in model.parameters():
            if param.dim() == 1:
                param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(out)
    processor = LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=14,
        vision_feature_select_strategy=strategy,
        image_token=IMAGE_TOKEN,
        num_additional_image_tokens=1 if vision == "clip" else 0,
        chat_template=LLAVA_TEMPLATE,
    )
    processor.save_pretrained(out)
    return out


def images(n: int, size: int = 56, seed: int = 0) -> list:
    """`n` random RGB PIL images."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)) for _ in range(n)]


def greedy_reference(model, processor, max_tokens: int):
    """transformers' greedy generate on the processor's output for (text, images), one prompt at a time."""

    @torch.no_grad()
    def generate(text: str, pictures: list) -> list[int]:
        inputs = processor(text=[text], images=pictures or None, return_tensors="pt")
        out = model.generate(**inputs, max_new_tokens=max_tokens, do_sample=False)
        return out[0, inputs["input_ids"].shape[1] :].tolist()

    return generate
