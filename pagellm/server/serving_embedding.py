"""OpenAI's embeddings (`POST /v1/embeddings`, vLLM's `serving_embedding.py`): one engine request per
input, pooled by the engine (a model served with `--runner pooling`). `ServingEmbedding.pool` is the part
the other pooling routes (serving_score.py) share."""

from __future__ import annotations

import asyncio
import base64
import logging
import uuid

import numpy as np
from fastapi import Request

from pagellm.core.pooling import PoolingParams
from pagellm.engine.outputs import PoolingRequestOutput
from pagellm.server import errors
from pagellm.server.protocol import EmbeddingData, EmbeddingRequest, EmbeddingResponse, EmbeddingUsage
from pagellm.server.serving_base import Prompts, ServingBase, error_param, final_outputs

logger = logging.getLogger("pagellm")

MAX_EMBEDDING_INPUTS = 2048  # OpenAI's limit on one embeddings request's inputs


class ServingEmbedding(ServingBase):
    async def embeddings(self, request: EmbeddingRequest, raw_request: Request) -> EmbeddingResponse:
        model = self.served.resolve(request.model)
        self.check_pooling_runner("embeddings")
        prompts = await asyncio.to_thread(self.tokenize_prompts, request.inputs())
        params = PoolingParams(dimensions=request.dimensions, normalize=request.normalize)
        request_id = f"embd-{uuid.uuid4().hex}"
        finals = await self.pool(request_id, prompts, params, request.priority, "input", model, raw_request)
        data = [
            EmbeddingData(index=i, embedding=encode_embedding(o.outputs.embedding, request.encoding_format))
            for i, o in enumerate(finals)
        ]
        tokens = sum(len(o.prompt_token_ids) for o in finals)
        usage = EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens)
        return EmbeddingResponse(id=request_id, model=model, data=data, usage=usage)

    def check_pooling_runner(self, what: str) -> None:
        """400 naming `model` on a server that generates text."""
        if self.llm.config.runner != "pooling":
            raise errors.bad_request(
                f"this server generates text; {what} need a model served with --runner pooling", "model"
            )

    async def pool(
        self,
        request_id: str,
        prompts: Prompts,
        params: PoolingParams,
        priority: int,
        prompt_field: str,
        model: str,
        raw_request: Request,
    ) -> list[PoolingRequestOutput]:
        """One engine request per prompt, pooled; their finished outputs in order. 400 naming
        `prompt_field` for no prompts or too many."""
        if not prompts:
            raise errors.bad_request(
                f"{prompt_field} is empty; give a string, a list of strings or token ids", prompt_field
            )
        if len(prompts) > MAX_EMBEDDING_INPUTS:
            raise errors.bad_request(
                f"{prompt_field} has {len(prompts)} items; send at most {MAX_EMBEDDING_INPUTS} at once",
                prompt_field,
            )
        lora = self.served.lora(model)
        streams = await self.add_requests(
            request_id, prompts, params, priority, prompt_field, lora, log_each=False
        )
        if self.log_requests:
            logger.info("request %s: %d inputs, %s", request_id, len(prompts), params)
        return await final_outputs(streams, raw_request)

    def refused_param(self, exc: ValueError, prompt_field: str) -> str | None:
        """dimensions when the check names it, else the input."""
        field = error_param(exc)
        return field if field == "dimensions" else prompt_field


def encode_embedding(embedding: list[float], encoding_format: str) -> list[float] | str:
    """float: the list; base64: the little-endian float32 bytes, base64-encoded (as OpenAI sends them)."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(embedding, dtype="<f4").tobytes()).decode("ascii")
    return embedding
