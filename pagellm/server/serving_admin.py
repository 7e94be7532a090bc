"""The endpoints around generation: health, version, Prometheus metrics, the served models, tokenize and
detokenize, and loading and unloading LoRA adapters at run time (`--allow-runtime-lora-updating`)."""

from __future__ import annotations

import asyncio
from http import HTTPStatus
from typing import Any

from fastapi.responses import PlainTextResponse, Response

from pagellm import __version__
from pagellm.engine.async_llm import AsyncLLM
from pagellm.server import errors
from pagellm.server.metrics import PrometheusStatLogger
from pagellm.server.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    LoadLoRARequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    UnloadLoRARequest,
    VersionResponse,
)
from pagellm.server.serving_base import ServingBase
from pagellm.server.serving_models import ServedModels


class ServingAdmin(ServingBase):
    def __init__(self, llm: AsyncLLM, models: ServedModels, **options: Any):
        """Registers the engine's Prometheus stat logger (what /metrics exposes); `options` are
        `ServingBase`'s."""
        super().__init__(llm, models, **options)
        self.stat_logger = PrometheusStatLogger(models.names[0])
        llm.add_stat_logger(self.stat_logger)

    async def health(self) -> Response:
        if self.llm.is_running:
            return Response(status_code=HTTPStatus.OK)
        return errors.error_response(
            errors.APIError(HTTPStatus.SERVICE_UNAVAILABLE, "the engine is not running", type="server_error")
        )

    async def version(self) -> VersionResponse:
        return VersionResponse(version=__version__)

    async def metrics(self) -> Response:
        self.stat_logger.count_rejections(self.llm.num_rejected)
        return Response(self.stat_logger.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def models(self) -> ModelList:
        names = self.served.names
        root = self.llm.config.model or names[0]
        cards = [ModelCard(id=n, root=root, max_model_len=self.llm.max_model_len) for n in names]
        cards += [
            ModelCard(id=name, root=root, parent=names[0], max_model_len=self.llm.max_model_len)
            for name in self.served.loras
        ]
        return ModelList(data=cards)

    async def load_lora_adapter(self, body: LoadLoRARequest) -> Response:
        try:
            await asyncio.to_thread(self.served.add_lora, body.lora_name, body.lora_path)
        except ValueError as exc:
            raise errors.bad_request(str(exc), "lora_name" if "already" in str(exc) else "lora_path") from exc
        return PlainTextResponse(f"loaded LoRA adapter {body.lora_name}")

    async def unload_lora_adapter(self, body: UnloadLoRARequest) -> Response:
        self.served.remove_lora(body.lora_name)
        return PlainTextResponse(f"unloaded LoRA adapter {body.lora_name}")

    async def tokenize(self, request: TokenizeRequest) -> TokenizeResponse:
        self.served.resolve(request.model)
        if request.messages is not None:
            tokens = await asyncio.to_thread(
                self.chat_prompt_ids, request.messages, None, request.add_generation_prompt
            )
        elif request.prompt is not None:
            tokens = await asyncio.to_thread(
                self.tokenizer.encode, request.prompt, add_special_tokens=request.add_special_tokens
            )
        else:
            raise errors.bad_request("give either prompt or messages", "prompt")
        return TokenizeResponse(tokens=tokens, count=len(tokens), max_model_len=self.llm.max_model_len)

    async def detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        self.served.resolve(request.model)
        vocab = len(self.tokenizer)
        bad = [t for t in request.tokens if not 0 <= t < vocab]
        if bad:
            raise errors.bad_request(
                f"token id {bad[0]} is out of range for the vocabulary of {vocab}", "tokens"
            )
        return DetokenizeResponse(prompt=await asyncio.to_thread(self.tokenizer.decode, request.tokens))
