"""The models a server answers to (vLLM's `serving_models.py`): its served names and the LoRA adapters it
serves, loaded at start-up (`--lora-modules`) or at run time (`--allow-runtime-lora-updating`)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from pagellm.engine.async_llm import AsyncLLM
from pagellm.lora.adapter import load_adapter
from pagellm.lora.request import LoRARequest
from pagellm.server import errors


class ServedModels:
    """The model names this server answers to (the first is the default for requests naming none) and the
    LoRA adapters it serves, each as a model of its own name."""

    def __init__(self, llm: AsyncLLM, names: Sequence[str]):
        if not names:
            raise ValueError("served_model_names needs at least one name")
        self.llm = llm
        self.names = list(names)
        self.loras: dict[str, LoRARequest] = {}  # served adapter name -> its request
        self._lora_ids = itertools.count(1)

    def resolve(self, name: str | None) -> str:
        """The model a request names (the default when it names none); 404 for one not served."""
        if name is None:
            return self.names[0]
        if name not in self.names and name not in self.loras:
            raise errors.model_not_found(name)
        return name

    def lora(self, model: str) -> LoRARequest | None:
        """The adapter served as `model`; None for the base model."""
        return self.loras.get(model)

    def add_lora(self, name: str, path: str) -> LoRARequest:
        """Serve the adapter at `path` as model `name` (its config is checked now: ValueError if bad)."""
        if not self.llm.config.enable_lora:
            raise ValueError("LoRA adapters need the engine started with --enable-lora")
        if name in self.loras or name in self.names:
            raise ValueError(f"a model named {name!r} is already served")
        load_adapter(path, self.llm.config.max_lora_rank)
        self.loras[name] = LoRARequest(name, next(self._lora_ids), path)
        return self.loras[name]

    def remove_lora(self, name: str) -> None:
        """Stop serving the adapter `name`; 404 when none is served under it."""
        if self.loras.pop(name, None) is None:
            raise errors.model_not_found(name)
