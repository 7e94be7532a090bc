"""Scores and classes from a classification model served with `--runner pooling` (vLLM's `serving_score.py`
and `serving_classification.py`): `/v1/score` and `/v1/rerank`, `/v2/rerank` (Jina's and Cohere's shape)
score text pairs, `/classify` gives each input's class probabilities, `/pooling` a model's pooled output
as it is (class probabilities, or the embedding of a model without a classification head).

A pair is one engine request whose classify output is the head's logit at the last token. A
`*ForSequenceClassification` model reads the pair as its tokenizer joins two texts (`tokenizer(query,
document)`, as cross-encoders are trained); a Qwen3-Reranker (`is_original_qwen3_reranker`) reads its model
card's prompt: the system line, `<Instruct>: ... <Query>: ... <Document>: ...` and the empty thinking block,
each part tokenized as the card does. The score is the logit through a sigmoid (`core.pooling.activate`).
"""

from __future__ import annotations

import asyncio
import uuid

from fastapi import Request

from pagellm.core.pooling import Classifier, PoolingParams, activate
from pagellm.engine.outputs import PoolingRequestOutput
from pagellm.server import errors
from pagellm.server.protocol_pooling import (
    ClassificationData,
    ClassificationResponse,
    PoolingData,
    PoolingInputRequest,
    PoolingResponse,
    PoolingUsage,
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    ScoreData,
    ScoreRequest,
    ScoreResponse,
)
from pagellm.server.serving_base import Prompts, error_param
from pagellm.server.serving_embedding import ServingEmbedding, encode_embedding

# Qwen3-Reranker's prompt, as its model card writes it
QWEN3_RERANKER_PREFIX = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the "
    'Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n'
)
QWEN3_RERANKER_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
QWEN3_RERANKER_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"


class ServingScore(ServingEmbedding):
    async def score(self, request: ScoreRequest, raw_request: Request) -> ScoreResponse:
        model = self.served.resolve(request.model)
        classifier = self.scoring_head()
        firsts, seconds = _as_list(request.text_1), _as_list(request.text_2)
        if not firsts:
            raise errors.bad_request("text_1 is empty; give a string or a list of strings", "text_1")
        if len(firsts) == 1:
            firsts = firsts * len(seconds)
        if len(firsts) != len(seconds):
            raise errors.bad_request(
                f"text_2 has {len(seconds)} texts for {len(firsts)} in text_1; give one text_1 or as many "
                "as text_2",
                "text_2",
            )
        request_id = f"score-{uuid.uuid4().hex}"
        scores, tokens = await self._score_pairs(
            request_id,
            list(zip(firsts, seconds, strict=True)),
            request,
            classifier,
            "text_2",
            model,
            raw_request,
        )
        data = [ScoreData(index=i, score=s) for i, s in enumerate(scores)]
        return ScoreResponse(id=request_id, model=model, data=data, usage=_usage(tokens))

    async def rerank(self, request: RerankRequest, raw_request: Request) -> RerankResponse:
        model = self.served.resolve(request.model)
        classifier = self.scoring_head()
        request_id = f"rerank-{uuid.uuid4().hex}"
        pairs = [(request.query, document) for document in request.documents]
        scores, tokens = await self._score_pairs(
            request_id, pairs, request, classifier, "documents", model, raw_request
        )
        ranked = sorted(range(len(scores)), key=lambda i: scores[i], reverse=True)
        top = ranked[: request.top_n] if request.top_n else ranked
        results = [
            RerankResult(
                index=i,
                document=RerankDocument(text=request.documents[i]) if request.return_documents else None,
                relevance_score=scores[i],
            )
            for i in top
        ]
        return RerankResponse(id=request_id, model=model, usage=_usage(tokens), results=results)

    async def classify(self, request: PoolingInputRequest, raw_request: Request) -> ClassificationResponse:
        model = self.served.resolve(request.model)
        classifier = self.classifier("classification")
        request_id = f"classify-{uuid.uuid4().hex}"
        finals = await self._pool_inputs(request_id, request, "classify", model, raw_request)
        data = []
        for i, output in enumerate(finals):
            probs = activate(output.outputs.embedding, classifier.problem_type)
            best = max(range(len(probs)), key=probs.__getitem__)
            data.append(
                ClassificationData(
                    index=i, label=classifier.labels[best], probs=probs, num_classes=len(probs)
                )
            )
        return ClassificationResponse(id=request_id, model=model, data=data, usage=_usage(_tokens(finals)))

    async def pooling(self, request: PoolingInputRequest, raw_request: Request) -> PoolingResponse:
        """The model's own pooled output: a classification model's class probabilities, else the embedding."""
        model = self.served.resolve(request.model)
        self.check_pooling_runner("pooled outputs")
        classifier = self.llm.pooler.classifier if self.llm.pooler is not None else None
        request_id = f"pool-{uuid.uuid4().hex}"
        task = "embed" if classifier is None else "classify"
        finals = await self._pool_inputs(request_id, request, task, model, raw_request)
        data = []
        for i, output in enumerate(finals):
            vector = output.outputs.embedding
            if classifier is not None:
                vector = activate(vector, classifier.problem_type)
            data.append(PoolingData(index=i, data=encode_embedding(vector, request.encoding_format)))
        return PoolingResponse(id=request_id, model=model, data=data, usage=_usage(_tokens(finals)))

    # -- the parts --------------------------------------------------------------------------------------

    def classifier(self, what: str) -> Classifier:
        """The served model's classification head; 400 naming `model` on a server without one."""
        self.check_pooling_runner(what)
        pooler = self.llm.pooler
        if pooler is None or pooler.classifier is None:
            raise errors.bad_request(
                f"{what} needs a classification model (a *ForSequenceClassification checkpoint, or a "
                "reranker given by --hf-overrides classifier_from_token); this one only embeds: use "
                "/v1/embeddings",
                "model",
            )
        return pooler.classifier

    def scoring_head(self) -> Classifier:
        """A head with one logit, which scores pairs; 400 naming `model` for one with several labels."""
        classifier = self.classifier("scores")
        if classifier.num_labels != 1:
            raise errors.bad_request(
                f"scores need a model with one output (num_labels 1); this one has {classifier.num_labels} "
                "labels: use /classify",
                "model",
            )
        return classifier

    def pair_prompts(
        self, pairs: list[tuple[str, str]], classifier: Classifier, instruction: str | None
    ) -> Prompts:
        """The token ids of each (query, document) pair as the model was trained to read it; run it in a
        thread."""
        if not classifier.qwen3_reranker:
            return [(None, list(self.tokenizer(query, document)["input_ids"])) for query, document in pairs]
        prefix = self.tokenizer.encode(QWEN3_RERANKER_PREFIX, add_special_tokens=False)
        suffix = self.tokenizer.encode(QWEN3_RERANKER_SUFFIX, add_special_tokens=False)
        task = instruction if instruction is not None else QWEN3_RERANKER_INSTRUCTION
        prompts: Prompts = []
        for query, document in pairs:
            text = f"<Instruct>: {task}\n<Query>: {query}\n<Document>: {document}"
            prompts.append((None, [*prefix, *self.tokenizer.encode(text), *suffix]))
        return prompts

    async def _score_pairs(
        self,
        request_id: str,
        pairs: list[tuple[str, str]],
        request: ScoreRequest | RerankRequest,
        classifier: Classifier,
        prompt_field: str,
        model: str,
        raw_request: Request,
    ) -> tuple[list[float], int]:
        """Each pair's score, and the prompt tokens they took."""
        prompts = await asyncio.to_thread(self.pair_prompts, pairs, classifier, request.instruction)
        params = PoolingParams(task="classify")
        finals = await self.pool(
            request_id, prompts, params, request.priority, prompt_field, model, raw_request
        )
        scores = [activate(o.outputs.embedding, classifier.problem_type)[0] for o in finals]
        return scores, _tokens(finals)

    async def _pool_inputs(
        self, request_id: str, request: PoolingInputRequest, task: str, model: str, raw_request: Request
    ) -> list[PoolingRequestOutput]:
        prompts = await asyncio.to_thread(self.tokenize_prompts, request.inputs())
        params = PoolingParams(task=task)
        return await self.pool(request_id, prompts, params, request.priority, "input", model, raw_request)

    def refused_param(self, exc: ValueError, prompt_field: str) -> str | None:
        """model or task when the engine's check names them, else the prompts' field."""
        field = error_param(exc)
        return field if field in ("model", "task") else prompt_field


def _as_list(texts: str | list[str]) -> list[str]:
    return [texts] if isinstance(texts, str) else list(texts)


def _tokens(finals: list[PoolingRequestOutput]) -> int:
    return sum(len(o.prompt_token_ids) for o in finals)


def _usage(tokens: int) -> PoolingUsage:
    return PoolingUsage(prompt_tokens=tokens, total_tokens=tokens)
