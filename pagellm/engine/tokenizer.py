"""The tokenizer of a model directory as the engine and its front ends use it."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import threading
import time
from typing import Any

logger = logging.getLogger("pagellm")


def load_tokenizer(path: str) -> Any:
    """`AutoTokenizer` of the local directory `path`, with the chat template a multimodal checkpoint may
    ship only for its processor (`chat_template.json`, which tokenizers do not read: LLaVA 1.5's layout).

    Kept pickled in the cache (`_pickled_path`) and read from there by later starts: transformers 5 builds a
    BPE tokenizer by parsing tokenizer.json in Python (0.65-0.9 s for a 151,936-token vocabulary, on every
    start, in the engine and again in a front end), where the pickle holds the Rust tokenizer's own JSON,
    which it parses in ~0.3 s, and the same object comes back."""
    pickled = _pickled_path(path)
    if pickled is not None and os.path.isfile(pickled):
        try:
            with open(pickled, "rb") as f:
                return pickle.load(f)
        except Exception as exc:  # a file from another build of its libraries that the key missed
            logger.debug("the pickled tokenizer %s did not load (%s): loading afresh", pickled, exc)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    legacy = os.path.join(path, "chat_template.json")
    if getattr(tokenizer, "chat_template", None) is None and os.path.isfile(legacy):
        with open(legacy, encoding="utf-8") as f:
            tokenizer.chat_template = json.load(f).get("chat_template")
    if pickled is not None:
        _keep_pickled(tokenizer, pickled)
    return tokenizer


_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".onnx")


def _pickled_path(path: str) -> str | None:
    """Where `path`'s tokenizer is kept pickled: named by a hash of the versions of transformers and
    tokenizers, the directory and every file in it but the weights (name, size, modification time), so an
    edited or replaced file, or an upgrade, makes a new one. None where the directory cannot be listed."""
    import tokenizers
    import transformers

    from pagellm.core.paths import cache_dir

    try:
        directory = os.path.realpath(path)
        files = sorted(
            (entry.name, entry.stat().st_size, entry.stat().st_mtime_ns)
            for entry in os.scandir(directory)
            if entry.is_file() and not entry.name.endswith(_WEIGHT_SUFFIXES)
        )
    except OSError:
        return None
    key = repr((transformers.__version__, tokenizers.__version__, directory, files))
    name = hashlib.sha256(key.encode()).hexdigest()[:24]
    return os.path.join(cache_dir(), "tokenizers", name + ".pkl")


def _keep_pickled(tokenizer: Any, path: str) -> None:
    """`tokenizer` pickled at `path`, written under another name and renamed into place (a start reading
    it meanwhile sees the whole file or none); nothing where it does not pickle (remote code)."""
    try:
        data = pickle.dumps(tokenizer, protocol=pickle.HIGHEST_PROTOCOL)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        partial = f"{path}.{os.getpid()}.{threading.get_ident()}.partial"
        with open(partial, "wb") as f:
            f.write(data)
        os.replace(partial, path)
    except Exception as exc:  # loaded afresh next time
        logger.debug("the tokenizer was not kept pickled (%s: %s)", type(exc).__name__, exc)


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
