"""Tiny Qwen-VL checkpoints with their processors, built in the test: a random Qwen2.5-VL (window-attention
vision encoder, patch merger, Qwen2 decoder with the multimodal rope) and its processor's parts (a
Qwen2VLImageProcessor bounded to a few image tokens, a tokenizer trained here with the family's vision
tokens, and a chat template that writes them for image parts)."""

from __future__ import annotations

from pathlib import Path

import torch
from tiny import BOS_ID, EOS_ID, PAD_ID, SPECIAL_TOKENS, make_tokenizer

VISION_START, IMAGE_PAD, VISION_END = "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"
IMAGE = VISION_START + IMAGE_PAD + VISION_END
"""What a prompt's text holds where an image goes: the processor repeats the pad once per image token."""
QWEN_VL_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% else %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
PATCH, MERGE = 14, 2
MAX_PIXELS = 112 * 112
"""Images are resized to at most 8 x 8 patches: 16 image tokens."""


def make_tiny_qwen2_5_vl(out: Path, seed: int = 0) -> Path:
    """A tiny Qwen2_5_VLForConditionalGeneration and its processor in `out`. The vision encoder has two
    blocks, the first attending within windows of 2 x 2 merged patches (56 pixels), the second over the
    whole image; the decoder's 16-wide heads rotate in mrope sections of 2, 3 and 3 frequencies (t, h, w)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLImageProcessor

    tokenizer = make_tokenizer(384, (*SPECIAL_TOKENS, VISION_START, IMAGE_PAD, VISION_END), QWEN_VL_TEMPLATE)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in (VISION_START, IMAGE_PAD, VISION_END)}
    text = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-6,
        max_position_embeddings=512,
        initializer_range=0.15,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
    )
    vision = dict(
        depth=2,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        patch_size=PATCH,
        spatial_merge_size=MERGE,
        temporal_patch_size=2,
        window_size=56,
        fullatt_block_indexes=[1],
        out_hidden_size=64,
        initializer_range=0.15,
    )
    config = Qwen2_5_VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids[IMAGE_PAD],
        vision_start_token_id=ids[VISION_START],
        vision_end_token_id=ids[VISION_END],
    )
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(config)
    with torch.no_grad():  # norms and biases away from their 1/0 initialisation, as trained weights are
        for param in model.parameters():
            if param.dim() == 1:
                param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(out)
    # the processor's parts: transformers' Qwen2_5_VLProcessor itself cannot be built without torchvision
    # (its video processor needs it); AutoProcessor assembles it from these where torchvision is installed
    Qwen2VLImageProcessor(
        min_pixels=56 * 56, max_pixels=MAX_PIXELS, patch_size=PATCH, merge_size=MERGE
    ).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def processor(checkpoint: Path):
    """The checkpoint's processor as the engine loads it (for images alone without torchvision)."""
    from pagellm.models.qwen_vl import Qwen2_5_VLForConditionalGeneration

    return Qwen2_5_VLForConditionalGeneration.load_processor(str(checkpoint))
