"""A tiny Qwen3-VL checkpoint with its processor, built in the test: a random Qwen3VLForConditionalGeneration
(learned position embedding smaller than the images' grids, so it is interpolated; deepstack mergers; a
Qwen3 decoder with the interleaved multimodal rope) and its processor's parts (a Qwen2VLImageProcessor with
Qwen3-VL's 16-pixel patches bounded to a few image tokens, a tokenizer trained here with the family's
vision tokens, the Qwen-VL chat template of tiny_qwen_vl.py)."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from tiny import BOS_ID, EOS_ID, PAD_ID, SPECIAL_TOKENS, make_tokenizer
from tiny_qwen_vl import IMAGE_PAD, QWEN_VL_TEMPLATE, VISION_END, VISION_START

PATCH, MERGE = 16, 2
MAX_PIXELS = 128 * 128
"""Images are resized to at most 8 x 8 patches: 16 image tokens."""
MOE_TEXT = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24, mlp_only_layers=[1])
"""The MoE decoder's experts. Width 24, not 32: with hidden size 64 a width of 32 would give the fused
gate_up_proj one shape in both layouts ([E, 64, 64]), leaving the released layout's transpose untested."""


def make_tiny_qwen3_vl(out: Path, seed: int = 0, moe: bool = False) -> Path:
    """A tiny Qwen3VLForConditionalGeneration and its processor in `out`. The vision encoder has three
    blocks, deepstack mergers after the first two (added after decoder layers 0 and 1 of 3) and a 6 x 6
    position table; the decoder ties its output projection to the embedding, and its 16-wide heads rotate
    their 8 frequencies interleaved t, h, w (mrope_section [3, 3, 2], which in contiguous sections would
    place them differently).

    `moe`: a Qwen3VLMoeForConditionalGeneration instead (`MOE_TEXT`): 8 experts of width 24, top 2, decoder
    layer 1 dense (`mlp_only_layers`), an output projection of its own (as Qwen3-VL-30B-A3B); saved as
    transformers writes it, the experts fused in its modules' layout ([E, 2I, H] and [E, H, I])."""
    import transformers
    from transformers import Qwen2VLImageProcessor

    tokenizer = make_tokenizer(384, (*SPECIAL_TOKENS, VISION_START, IMAGE_PAD, VISION_END), QWEN_VL_TEMPLATE)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in (VISION_START, IMAGE_PAD, VISION_END)}
    text = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        max_position_embeddings=512,
        initializer_range=0.15,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": [3, 3, 2],
            "mrope_interleaved": True,
        },
    )
    vision = dict(
        depth=3,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        patch_size=PATCH,
        spatial_merge_size=MERGE,
        temporal_patch_size=2,
        out_hidden_size=64,
        num_position_embeddings=36,
        deepstack_visual_indexes=[0, 1],
        initializer_range=0.15,
    )
    family = "Qwen3VLMoe" if moe else "Qwen3VL"
    config = getattr(transformers, f"{family}Config")(
        text_config={**text, **MOE_TEXT} if moe else text,
        vision_config=vision,
        image_token_id=ids[IMAGE_PAD],
        vision_start_token_id=ids[VISION_START],
        vision_end_token_id=ids[VISION_END],
        tie_word_embeddings=not moe,  # as Qwen3-VL-2B and -4B; the MoE models are untied
    )
    torch.manual_seed(seed)
    model = getattr(transformers, f"{family}ForConditionalGeneration")(config)
    with torch.no_grad():  # weights spread wide, norms and biases away from their 1/0 initialisation
        for param in model.parameters():
            if param.dim() == 1:
                param.add_(torch.randn_like(param) * 0.1)
            else:
                param.copy_(torch.randn_like(param) * 0.15)
    model.save_pretrained(out)
    # the processor's parts: transformers' Qwen3VLProcessor cannot be built without torchvision (its video
    # processor needs it); AutoProcessor assembles it from these where torchvision is installed
    Qwen2VLImageProcessor(
        min_pixels=64 * 64,
        max_pixels=MAX_PIXELS,
        patch_size=PATCH,
        merge_size=MERGE,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
    ).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def with_released_expert_layout(checkpoint: Path, out: Path) -> Path:
    """A copy of a tiny MoE checkpoint with its experts as the released Qwen3-VL-MoE checkpoints store them,
    transposed to x @ W's [E, H, 2I] and [E, I, H]; transformers transposes them back as it loads."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(checkpoint, out)
    weights = load_file(out / "model.safetensors")
    for name, tensor in weights.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            weights[name] = tensor.transpose(1, 2).contiguous()
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out


def processor(checkpoint: Path):
    """The checkpoint's processor as the engine loads it (for images alone without torchvision)."""
    from pagellm.models.qwen3_vl import Qwen3VLForConditionalGeneration

    return Qwen3VLForConditionalGeneration.load_processor(str(checkpoint))
