"""The tokenizer of a model directory as the engine and its front ends use it."""

from __future__ import annotations

import json
import os
from typing import Any


def load_tokenizer(path: str) -> Any:
    """`AutoTokenizer` of the local directory `path`, with the chat template a multimodal checkpoint may
    ship only for its processor (`chat_template.json`, which tokenizers do not read: LLaVA 1.5's layout)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    legacy = os.path.join(path, "chat_template.json")
    if getattr(tokenizer, "chat_template", None) is None and os.path.isfile(legacy):
        with open(legacy, encoding="utf-8") as f:
            tokenizer.chat_template = json.load(f).get("chat_template")
    return tokenizer
