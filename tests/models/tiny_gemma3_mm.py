"""A tiny Gemma 3 with images (`Gemma3ForConditionalGeneration`) and its processor, built in the test: a random
model (SigLIP tower, projector, Gemma 3 decoder with 5 local layers to 1 global), the family's image
processor (`Gemma3ImageProcessor`, its SigLIP defaults, at a tiny image size), a tokenizer trained here with
Gemma 3's image tokens, and a chat template that writes `<start_of_image>` for image parts."""

from __future__ import annotations

from pathlib import Path

import torch
from tiny import SPECIAL_TOKENS, make_tokenizer, tiny_config

BOI, IMAGE, EOI = "<start_of_image>", "<image_soft_token>", "<end_of_image>"
GEMMA3_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}<start_of_image>"
    "{% else %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_tiny_gemma3_mm(
    out: Path, image_size: int = 56, tokens_per_image: int = 16, sliding_window: int = 8, seed: int = 0
) -> Path:
    """The checkpoint and its Gemma3Processor in `out`: images of `image_size` pixels in patches of 7,
    pooled to `tokens_per_image` tokens; `\\n\\n<start_of_image>`, the tokens, `<end_of_image>\\n\\n` per image.
    Local layers see `sliding_window` tokens: fewer than an image's span of context, so the window and
    the bidirectional image mask meet."""
    from transformers import (
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        Gemma3ImageProcessor,
        Gemma3Processor,
    )

    tokenizer = image_tokenizer({"boi_token": BOI, "image_token": IMAGE, "eoi_token": EOI}, GEMMA3_TEMPLATE)
    text = tiny_config("gemma3_text", vocab_size=len(tokenizer), sliding_window=sliding_window)
    vision = dict(
        model_type="siglip_vision_model",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=image_size,
        patch_size=7,
    )
    config = Gemma3Config(
        text_config=text.to_dict(),
        vision_config=vision,
        mm_tokens_per_image=tokens_per_image,
        image_token_index=tokenizer.image_token_id,
        boi_token_index=tokenizer.boi_token_id,
        eoi_token_index=tokenizer.eoi_token_id,
    )
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(config)
    with torch.no_grad():  # norms, biases and the projection away from their initial 0/1, as trained ones are
        for name, param in model.named_parameters():
            if param.dim() == 1:
                param.add_(torch.randn_like(param) * 0.1)
            elif "mm_input_projection" in name:
                param.copy_(torch.randn_like(param) * 0.2)
    model.save_pretrained(out)
    processor = Gemma3Processor(
        image_processor=Gemma3ImageProcessor(size={"height": image_size, "width": image_size}),
        tokenizer=tokenizer,
        chat_template=GEMMA3_TEMPLATE,
        image_seq_length=tokens_per_image,
    )
    processor.save_pretrained(out)
    return out


def image_tokenizer(tokens: dict[str, str], chat_template: str):
    """A tokenizer trained here with `tokens` (attribute -> token: `image_token`...) after the usual special
    tokens, each also an attribute of the tokenizer, which is where the processors read them."""
    from transformers import PreTrainedTokenizerFast

    trained = make_tokenizer(384, (*SPECIAL_TOKENS, *tokens.values()), chat_template)
    return PreTrainedTokenizerFast(
        tokenizer_object=trained.backend_tokenizer,
        bos_token=trained.bos_token,
        eos_token=trained.eos_token,
        pad_token=trained.pad_token,
        chat_template=chat_template,
        extra_special_tokens=tokens,
    )
