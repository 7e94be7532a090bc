"""The request and response bodies of the pooling routes beyond embeddings, in the shapes vLLM serves them:
scores of text pairs (`/v1/score`), reranking (`/v1/rerank`, `/v2/rerank`: Jina's and Cohere's), class
probabilities (`/classify`) and a model's raw pooled output (`/pooling`)."""

from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, Field, field_validator

from pagellm.server.protocol import OpenAIModel, TokenIds, as_prompt_list, valid_unicode


class _PairFields(OpenAIModel):
    model: str | None = None
    priority: int = 0
    # pagellm's: the task line of Qwen3-Reranker's prompt (its model card's default when left out)
    instruction: str | None = None


class ScoreRequest(_PairFields):
    """vLLM's: each text_1 scored against each text_2 (one text_1 against every text_2, or pairwise)."""

    text_1: str | list[str]
    text_2: str | list[str]

    _valid_texts = field_validator("text_1", "text_2", "instruction")(valid_unicode)


class RerankRequest(_PairFields):
    """Jina's and Cohere's (as vLLM takes it): the documents ranked by their score against the query."""

    query: str
    documents: list[str]
    top_n: int = Field(default=0, ge=0)  # 0: every document
    return_documents: bool = True

    _valid_texts = field_validator("query", "documents", "instruction")(valid_unicode)


class PoolingInputRequest(OpenAIModel):
    """/classify and /pooling: one output per input, as /v1/embeddings takes them."""

    model: str | None = None
    input: str | list[str] | TokenIds | list[TokenIds]
    encoding_format: Literal["float", "base64"] = "float"
    priority: int = 0

    _valid_input = field_validator("input")(valid_unicode)

    def inputs(self) -> list[str | list[int]]:
        return as_prompt_list(self.input)


class PoolingUsage(BaseModel):
    prompt_tokens: int = 0
    total_tokens: int = 0


class ScoreData(BaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[ScoreData]
    usage: PoolingUsage


class RerankDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int
    document: RerankDocument | None = None
    relevance_score: float


class RerankResponse(BaseModel):
    id: str
    model: str
    usage: PoolingUsage
    results: list[RerankResult]


class ClassificationData(BaseModel):
    index: int
    label: str
    probs: list[float]
    num_classes: int


class ClassificationResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[ClassificationData]
    usage: PoolingUsage


class PoolingData(BaseModel):
    index: int
    object: Literal["pooling"] = "pooling"
    data: list[float] | str  # a str: base64 of the little-endian float32 values


class PoolingResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[PoolingData]
    usage: PoolingUsage
