"""The tokenizer of a model directory as the engine and its front ends use it."""

from __future__ import annotations

import json
import os
import threading
import time
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


class TokenizerPreload(threading.Thread):
    """A front end's tokenizer, made while its engine starts in another process, which takes seconds: on a
    daemon thread it imports what `load_tokenizer` needs of transformers (the tokenizer classes, and the
    configuration machinery `AutoTokenizer` reads the model's config with; 2-3 s on two cores), then loads
    the tokenizer from where the engine will most likely say it is (`likely_tokenizer_path`). A GGUF file seen
    for the first time has no such place until the engine has converted its config and tokenizer, which it
    does first thing: the thread waits for that copy (polling) and loads it while the engine loads the
    weights (0.8 s off a first start of model M). `tokenizer(path)`, given the path the engine reports,
    returns the one loaded where the paths agree and loads it afresh where they do not."""

    POLL_S = 0.1
    WAIT_S = 600.0

    def __init__(self, config: Any):
        super().__init__(name="pagellm-tokenizer-preload", daemon=True)
        self.config = config
        self.path: str | None = None
        self.loaded: Any = None
        self._reported = threading.Event()
        self.start()

    def run(self) -> None:
        import transformers.configuration_utils  # noqa: F401
        from transformers import AutoTokenizer  # noqa: F401

        try:
            self.path = likely_tokenizer_path(self.config)
            gguf_file = None if self.path is not None else _local_gguf_file(self.config)
            deadline = time.monotonic() + self.WAIT_S
            while self.path is None and gguf_file is not None and not self._reported.wait(self.POLL_S):
                self.path = _converted_copy_path(gguf_file)
                if time.monotonic() > deadline:  # an engine that never reports (its start failed)
                    break
            if self.path is not None:
                self.loaded = load_tokenizer(self.path)
        except Exception:  # a guess only: the engine's path is loaded the usual way, errors and all
            self.path = self.loaded = None

    def tokenizer(self, path: str) -> Any:
        self._reported.set()
        self.join()
        if self.loaded is not None and self.path == path:
            return self.loaded
        return load_tokenizer(path)


def likely_tokenizer_path(config: Any) -> str | None:
    """The tokenizer directory the engine will report (`EngineFacts.tokenizer_path`: --tokenizer, else the
    model's directory) where it is known without resolving anything slow: a local --tokenizer or model
    directory, or a GGUF file's converted copy made by an earlier start. None otherwise (a Hugging Face id,
    a GGUF file seen for the first time)."""
    if config.tokenizer is not None:
        return config.tokenizer if os.path.isdir(config.tokenizer) else None
    from pagellm.engine.default_model import default_model_path

    model = config.model or default_model_path()
    if os.path.isdir(model) and not config.gguf_file:
        return model
    gguf_file = _local_gguf_file(config)
    return None if gguf_file is None else _converted_copy_path(gguf_file)


def _local_gguf_file(config: Any) -> str | None:
    """The model's GGUF file where it is one on this machine and the tokenizer is the model's."""
    from pagellm.engine.default_model import default_model_path

    model = config.model or default_model_path()
    if config.tokenizer is None and os.path.isfile(model) and model.endswith(".gguf"):
        return os.path.abspath(model)
    return None


def _converted_copy_path(gguf_file: str) -> str | None:
    from pagellm.core.paths import cache_dir
    from pagellm.models.gguf_checkpoint import converted_copy

    copy = converted_copy(gguf_file, cache_dir())
    return None if copy is None else str(copy)
