"""`/v1/score`, `/v1/rerank`, `/v2/rerank`, `/classify` and `/pooling` on tiny classification models, over
HTTP: scores equal transformers' for a Qwen3-Reranker-style causal LM served with vLLM's `--hf-overrides`
(a real `pagellm serve`; the model card's prompt and its yes/no softmax) and for `*ForSequenceClassification`
checkpoints (their score head on the last token), and every body validates against the shapes vLLM, Jina
and Cohere document (written out here, apart from the server's own models). Bad requests get 400 naming
the field."""

from __future__ import annotations

import json
from typing import Literal

import httpx
import pytest
import torch
from openai_asgi import call_app
from pydantic import BaseModel, ConfigDict, StrictFloat, StrictInt, StrictStr
from server_harness import ServerProcess
from tiny import make_tokenizer, randomise_vectors, tiny_config

from pagellm import AsyncLLM
from pagellm.server.app import build_app
from pagellm.server.serving_score import (
    QWEN3_RERANKER_INSTRUCTION,
    QWEN3_RERANKER_PREFIX,
    QWEN3_RERANKER_SUFFIX,
)

QUERY = "What does a scheduler decide?"
DOCUMENTS = [
    "A scheduler decides how many tokens each request runs in one step.",
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention stores keys and values in fixed-size blocks.",
]
LABELS = {0: "negative", 1: "neutral", 2: "positive"}
QWEN3_RERANKER = {
    "architectures": ["Qwen3ForSequenceClassification"],
    "classifier_from_token": ["no", "yes"],
    "is_original_qwen3_reranker": True,
}
ENGINE = dict(dtype="float32", num_kv_blocks=64, max_model_len=512, engine_process=False, runner="pooling")


# -- the published shapes (vLLM's score and classify protocol, Jina's and Cohere's rerank) ---------------


class Shape(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Usage(Shape):
    prompt_tokens: StrictInt
    total_tokens: StrictInt


class ScoreItem(Shape):
    index: StrictInt
    object: Literal["score"]
    score: StrictFloat


class ScoreBody(Shape):
    id: StrictStr
    object: Literal["list"]
    created: StrictInt
    model: StrictStr
    data: list[ScoreItem]
    usage: Usage


class JinaDocument(Shape):
    text: StrictStr


class JinaResult(Shape):
    index: StrictInt
    document: JinaDocument | None = None
    relevance_score: StrictFloat


class JinaRerankBody(Shape):
    model: StrictStr
    usage: Usage
    results: list[JinaResult]
    id: StrictStr  # vLLM's addition


class CohereResult(BaseModel):  # Cohere's v2 results: index and relevance_score (document optional)
    index: StrictInt
    relevance_score: StrictFloat


class CohereRerankBody(BaseModel):
    id: StrictStr
    results: list[CohereResult]


class ClassifyItem(Shape):
    index: StrictInt
    label: StrictStr
    probs: list[StrictFloat]
    num_classes: StrictInt


class ClassifyBody(Shape):
    id: StrictStr
    object: Literal["list"]
    created: StrictInt
    model: StrictStr
    data: list[ClassifyItem]
    usage: Usage


class PoolingItem(Shape):
    index: StrictInt
    object: Literal["pooling"]
    data: list[StrictFloat]


class PoolingBody(Shape):
    id: StrictStr
    object: Literal["list"]
    created: StrictInt
    model: StrictStr
    data: list[PoolingItem]
    usage: Usage


# -- tiny checkpoints and transformers' scores ----------------------------------------------------------


def _tokenizer():
    tokenizer = make_tokenizer()
    missing = [t for t in ("yes", "no") if t not in tokenizer.get_vocab()]
    tokenizer.add_tokens(missing)  # Qwen3-Reranker reads the logits of these two
    return tokenizer


def _save(model, tokenizer, path):
    randomise_vectors(model)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A Qwen3 causal LM with yes/no tokens, a Qwen3 sequence classifier (one score) and a Llama one (3
    labels), random weights."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    root = tmp_path_factory.mktemp("score")
    tokenizer = _tokenizer()
    torch.manual_seed(0)
    causal = AutoModelForCausalLM.from_config(tiny_config("qwen3", len(tokenizer)))
    scorer = AutoModelForSequenceClassification.from_config(
        tiny_config("qwen3", len(tokenizer), num_labels=1)
    )
    classes = tiny_config("llama", len(tokenizer), num_labels=3, id2label=LABELS)
    classifier = AutoModelForSequenceClassification.from_config(classes)
    return {
        "reranker": _save(causal, tokenizer, root / "reranker"),
        "scorer": _save(scorer, tokenizer, root / "scorer"),
        "classifier": _save(classifier, tokenizer, root / "classifier"),
    }


def card_scores(model_dir, query: str, documents: list[str], instruction: str) -> list[float]:
    """Qwen3-Reranker's model card: prefix + formatted pair + suffix, P(yes) of the yes/no softmax."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prefix = tokenizer.encode(QWEN3_RERANKER_PREFIX, add_special_tokens=False)
    suffix = tokenizer.encode(QWEN3_RERANKER_SUFFIX, add_special_tokens=False)
    no, yes = tokenizer.convert_tokens_to_ids("no"), tokenizer.convert_tokens_to_ids("yes")
    scores = []
    for doc in documents:
        pair = f"<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {doc}"
        ids = prefix + tokenizer(pair)["input_ids"] + suffix
        with torch.no_grad():
            last = model(input_ids=torch.tensor([ids])).logits[0, -1]
        pair_logits = torch.log_softmax(torch.stack([last[no], last[yes]]), dim=0)
        scores.append(pair_logits[1].exp().item())
    return scores


def head_logits(model_dir, pairs: list[tuple[str, ...]]) -> list[torch.Tensor]:
    """A transformers sequence classifier's logits for each input (a text, or a text pair)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(**tokenizer(*pair, return_tensors="pt")).logits[0] for pair in pairs]


# -- servers --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reranker_server(models, tmp_path_factory):
    """`pagellm serve` on the causal LM, made a reranker with vLLM's --hf-overrides."""
    args = ["--runner", "pooling", "--hf-overrides", json.dumps(QWEN3_RERANKER), "--dtype", "float32"]
    args += ["--num-kv-blocks", "64", "--max-model-len", "512", "--disable-log-requests"]
    log = tmp_path_factory.mktemp("log") / "serve.log"
    server = ServerProcess(models["reranker"], args, log)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def scorer_app(models):
    llm = AsyncLLM(str(models["scorer"]), **ENGINE)
    yield build_app(llm, ["scorer"], log_requests=False)
    llm.shutdown()


@pytest.fixture(scope="module")
def classifier_app(models):
    llm = AsyncLLM(str(models["classifier"]), **ENGINE)
    yield build_app(llm, ["classifier"], log_requests=False)
    llm.shutdown()


def test_qwen3_reranker_scores_equal_the_model_card(reranker_server, models):
    instruction = "Find the passage that answers the question"
    want = card_scores(models["reranker"], QUERY, DOCUMENTS, QWEN3_RERANKER_INSTRUCTION)
    want_instructed = card_scores(models["reranker"], QUERY, DOCUMENTS[:1], instruction)
    with httpx.Client(base_url=reranker_server.url, timeout=60) as http:
        v1 = http.post("/v1/rerank", json={"query": QUERY, "documents": DOCUMENTS, "top_n": 2})
        v2 = http.post(
            "/v2/rerank", json={"model": str(models["reranker"]), "query": QUERY, "documents": DOCUMENTS}
        )
        score = http.post("/v1/score", json={"text_1": QUERY, "text_2": DOCUMENTS})
        instructed = http.post(
            "/v1/score", json={"text_1": QUERY, "text_2": DOCUMENTS[0], "instruction": instruction}
        )
        openapi = http.get("/openapi.json").json()
    assert v1.status_code == v2.status_code == score.status_code == 200, (v1.text, v2.text, score.text)
    ranked = JinaRerankBody.model_validate(v1.json())
    CohereRerankBody.model_validate(v2.json())
    scores = ScoreBody.model_validate(score.json())
    assert [d.score for d in scores.data] == pytest.approx(want, abs=1e-5)
    order = sorted(range(3), key=lambda i: want[i], reverse=True)
    assert [r.index for r in ranked.results] == order[:2]
    assert [r.relevance_score for r in ranked.results] == pytest.approx(
        [want[i] for i in order[:2]], abs=1e-5
    )
    assert [r.document.text for r in ranked.results] == [DOCUMENTS[i] for i in order[:2]]
    assert len(JinaRerankBody.model_validate(v2.json()).results) == 3
    assert ranked.usage.total_tokens == scores.usage.total_tokens > 3 * 40
    assert ScoreBody.model_validate(instructed.json()).data[0].score == pytest.approx(
        want_instructed[0], abs=1e-5
    )
    for path in ("/v1/score", "/v1/rerank", "/v2/rerank", "/classify", "/pooling"):
        assert "post" in openapi["paths"][path]


def test_sequence_classifier_scores_equal_transformers(scorer_app, models):
    pairs = [(QUERY, d) for d in DOCUMENTS]
    want = [torch.sigmoid(logits)[0].item() for logits in head_logits(models["scorer"], pairs)]

    async def work(client, http):
        return (
            await http.post("/v1/score", json={"text_1": [QUERY] * 3, "text_2": DOCUMENTS}),
            await http.post(
                "/v1/rerank", json={"query": QUERY, "documents": DOCUMENTS, "return_documents": False}
            ),
            await http.post("/pooling", json={"input": DOCUMENTS[0]}),
        )

    score, rerank, pooled = call_app(scorer_app, work)
    assert [d.score for d in ScoreBody.model_validate(score.json()).data] == pytest.approx(want, abs=1e-5)
    results = JinaRerankBody.model_validate(rerank.json()).results
    assert [r.relevance_score for r in results] == pytest.approx(sorted(want, reverse=True), abs=1e-5)
    assert all(r.document is None for r in results)
    one = head_logits(models["scorer"], [(DOCUMENTS[0],)])[0]
    assert PoolingBody.model_validate(pooled.json()).data[0].data == pytest.approx(
        torch.sigmoid(one).tolist(), abs=1e-5
    )


def test_classify_gives_transformers_probabilities(classifier_app, models):
    want = [
        torch.softmax(logits, dim=0)
        for logits in head_logits(models["classifier"], [(d,) for d in DOCUMENTS])
    ]

    async def work(client, http):
        return (
            await http.post("/classify", json={"input": DOCUMENTS}),
            await http.post("/v1/score", json={"text_1": QUERY, "text_2": DOCUMENTS}),
        )

    classified, score = call_app(classifier_app, work)
    body = ClassifyBody.model_validate(classified.json())
    for item, probs in zip(body.data, want, strict=True):
        assert item.probs == pytest.approx(probs.tolist(), abs=1e-5)
        assert item.num_classes == 3 and item.label == LABELS[int(probs.argmax())]
    assert score.status_code == 400 and score.json()["error"]["param"] == "model"


def test_bad_requests_answer_400_naming_the_field(scorer_app, pooling_llm, llm):
    async def on_scorer(client, http):
        bodies = {
            "text_2": ("/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}),
            "text_1": ("/v1/score", {"text_1": [], "text_2": "c"}),
            "documents": ("/v1/rerank", {"query": "q", "documents": []}),
            "top_n": ("/v2/rerank", {"query": "q", "documents": ["d"], "top_n": -1}),
            "long": ("/v1/rerank", {"query": "q", "documents": ["word " * 600]}),
            "input": ("/classify", {"input": []}),
        }
        return {name: await http.post(path, json=body) for name, (path, body) in bodies.items()}

    answers = call_app(scorer_app, on_scorer)
    for name, answer in answers.items():
        assert answer.status_code == 400, (name, answer.text)
        assert answer.json()["error"]["param"] == {"long": "documents"}.get(name, name), answer.text

    async def elsewhere(client, http):
        return await http.post("/v1/rerank", json={"query": "q", "documents": ["d"]})

    for engine in (pooling_llm, llm):  # an embedding model; a generating server
        refused = call_app(build_app(engine, ["tiny"], log_requests=False), elsewhere)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "model", refused.text


def test_a_classifier_is_refused_a_generating_runner_and_bad_overrides(models):
    from pagellm import LLM
    from pagellm.core.errors import ConfigError

    with pytest.raises(ConfigError, match="runner='pooling'"):
        LLM(str(models["scorer"]), dtype="float32", max_model_len=64)
    unknown = {**QWEN3_RERANKER, "classifier_from_token": ["nope", "yes"]}
    with pytest.raises(ConfigError, match="no token 'nope'"):
        LLM(
            str(models["reranker"]), dtype="float32", max_model_len=64, runner="pooling", hf_overrides=unknown
        )
    with pytest.raises(ConfigError, match="hf_overrides: not valid JSON"):
        LLM(str(models["reranker"]), dtype="float32", max_model_len=64, hf_overrides="{")
