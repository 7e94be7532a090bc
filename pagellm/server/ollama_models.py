"""Ollama's model routes over the served models: `/api/tags` (what is served), `/api/show` (one model's
details, template, parameters and capabilities), `/api/ps` (what is loaded: everything served, for as long
as the server runs) and `/api/version`. What they say of a model comes from its directory (config.json,
the weight files' sizes and times) and the engine's facts; the `digest` is pagellm's own: the sha256 of
where the model came from and the name it is served under."""

from __future__ import annotations

import functools
import hashlib
import json
import os
from datetime import UTC, datetime
from typing import Any

from pagellm import __version__
from pagellm.models.gguf_header import gguf_file_type
from pagellm.sampling.params import SamplingParams
from pagellm.server import errors
from pagellm.server.protocol_ollama import (
    OllamaModelDetails,
    OllamaModelEntry,
    OllamaPsResponse,
    OllamaRunningModel,
    OllamaShowRequest,
    OllamaShowResponse,
    OllamaTagsResponse,
    OllamaVersionResponse,
)
from pagellm.server.serving_chat import ServingChat

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt")
NEVER = "9999-12-31T23:59:59Z"  # expires_at of a model that stays loaded while the server runs
_SHOWN_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


class OllamaModels:
    """The served models as Ollama lists them; read from disk once, when the app is built."""

    def __init__(self, chat: ServingChat):
        self.chat = chat
        self.llm = chat.llm
        self.source = str(self.llm.config.model or chat.served.names[0])
        self.directory = _model_directory(self.source, self.llm.facts.tokenizer_path)
        self.config = _read_config(self.directory)
        self.size, self.modified_at = _weights(self.source, self.directory)

    async def tags(self) -> OllamaTagsResponse:
        return OllamaTagsResponse(models=[self._entry(name) for name in self._names()])

    async def ps(self) -> OllamaPsResponse:
        running = [
            OllamaRunningModel(
                **self._entry(name).model_dump(), expires_at=NEVER, context_length=self.llm.max_model_len
            )
            for name in self._names()
        ]
        return OllamaPsResponse(models=running)

    async def show(self, body: OllamaShowRequest) -> OllamaShowResponse:
        name = self._served_name(body.model or body.name)
        model_type = self.config.get("model_type", "unknown")
        info: dict[str, Any] = {"general.architecture": model_type, "general.basename": name}
        for key, field in (
            ("context_length", None),
            ("embedding_length", "hidden_size"),
            ("block_count", "num_hidden_layers"),
        ):
            value = self.llm.max_model_len if field is None else self.config.get(field)
            if value is not None:
                info[f"{model_type}.{key}"] = value
        return OllamaShowResponse(
            modelfile=f"# served by pagellm {__version__}\nFROM {self.source}\n",
            parameters=self._parameters(),
            template=getattr(self.chat.tokenizer, "chat_template", None) or "",
            details=self._details(name),
            model_info=info,
            capabilities=self._capabilities(),
            modified_at=self.modified_at,
        )

    async def version(self) -> OllamaVersionResponse:
        return OllamaVersionResponse(version=__version__)

    # -- the parts --------------------------------------------------------------------------------------

    def _names(self) -> list[str]:
        return [*self.chat.served.names, *self.chat.served.loras]

    def _served_name(self, name: str | None) -> str:
        if not name:
            raise errors.bad_request("model is required", "model")
        if name.endswith(":latest") and name not in self._names():
            name = name.removesuffix(":latest")
        return self.chat.served.resolve(name)

    def _entry(self, name: str) -> OllamaModelEntry:
        digest = hashlib.sha256(f"{self.source}\0{name}".encode()).hexdigest()
        return OllamaModelEntry(
            name=name,
            model=name,
            modified_at=self.modified_at,
            size=self.size,
            digest=digest,
            details=self._details(name),
        )

    def _details(self, name: str) -> OllamaModelDetails:
        family = str(self.config.get("model_type", "unknown"))
        quantization = (self.config.get("quantization_config") or {}).get("quant_method")
        dtype = self.config.get("dtype") or self.config.get("torch_dtype") or ""
        return OllamaModelDetails(
            parent_model=self.chat.served.names[0] if name in self.chat.served.loras else "",
            format="gguf" if self.source.endswith(".gguf") else "safetensors",
            family=family,
            families=[family],
            quantization_level=self._file_type or str(quantization or dtype).upper(),
        )

    @functools.cached_property
    def _file_type(self) -> str | None:
        """A GGUF file's own type (`Q4_K_M`), as Ollama reports it; read once, on the first ask (the field
        can sit after the vocabulary: ~0.1 s)."""
        return (
            gguf_file_type(self.source)
            if self.source.endswith(".gguf") and os.path.isfile(self.source)
            else None
        )

    def _parameters(self) -> str:
        """The model's sampling defaults (its generation_config.json) that differ from the engine's."""
        defaults, engine = self.llm.default_sampling_params(), SamplingParams()
        lines = [
            f"{name} {getattr(defaults, name)}"
            for name in _SHOWN_DEFAULTS
            if getattr(defaults, name) != getattr(engine, name)
        ]
        return "\n".join(lines)

    def _capabilities(self) -> list[str]:
        if self.llm.config.runner == "pooling":
            return ["embedding"]
        capabilities = ["completion"]
        if self.chat.fim_ids is not None:
            capabilities.append("insert")
        if self.chat.enable_auto_tool_choice and self.chat.tool_parser is not None:
            capabilities.append("tools")
        if self.chat.reasoning is not None:
            capabilities.append("thinking")
        if self.llm.takes_images:
            capabilities.append("vision")
        return capabilities


def _model_directory(source: str, tokenizer_path: str) -> str | None:
    for path in (source, tokenizer_path):
        if path and os.path.isdir(path):
            return path
    return None


def _read_config(directory: str | None) -> dict[str, Any]:
    path = os.path.join(directory, "config.json") if directory else ""
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        config = json.load(f)
    return config if isinstance(config, dict) else {}


def _weights(source: str, directory: str | None) -> tuple[int, str]:
    """The weight files' total size and latest modification time (ISO 8601, UTC)."""
    if os.path.isfile(source):
        files = [source]
    elif directory:
        files = [os.path.join(directory, f) for f in os.listdir(directory) if f.endswith(WEIGHT_SUFFIXES)]
    else:
        files = []
    stats = [os.stat(f) for f in files if os.path.isfile(f)]
    latest = max((s.st_mtime for s in stats), default=0.0)
    modified = datetime.fromtimestamp(latest, UTC).isoformat().replace("+00:00", "Z")
    return sum(s.st_size for s in stats), modified
