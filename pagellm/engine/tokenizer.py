"""The tokenizer of a model directory as the engine and its front ends use it."""

from __future__ import annotations

import json
import os
import threading
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


def import_tokenizers_in_background() -> threading.Thread:
    """Import what `load_tokenizer` needs of transformers on a daemon thread and return it (join it before
    `load_tokenizer`). A front end whose engine starts in another process waits seconds for it; importing
    meanwhile takes 2-4 s on two cores off the time to the first request: the tokenizer classes, and the
    configuration machinery `AutoTokenizer` reads the model's config with (every model's config class
    imports `type_validators`, which imports transformers' weight-loading and distributed modules)."""

    def run() -> None:
        import transformers.configuration_utils  # noqa: F401
        import transformers.utils.type_validators  # noqa: F401
        from transformers import AutoTokenizer  # noqa: F401

    thread = threading.Thread(target=run, name="pagellm-import-tokenizers", daemon=True)
    thread.start()
    return thread
