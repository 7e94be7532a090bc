"""Embeddings (`runner="pooling"`): how a prompt's final hidden states become one vector.

`PoolerConfig` is vLLM's `pooler_config` (`pooling_type`: LAST, MEAN or CLS; `normalize`); `resolve_pooler`
fills what it leaves out from the model's sentence-transformers files (`modules.json`, its Pooling module's
`config.json`, a Normalize module) and else uses the default for decoder models, LAST and normalized.
`PoolingParams` is what one embedding request asks for (`dimensions`, `normalize`), as in vLLM.

A `*ForSequenceClassification` model (or a causal LM read through `classifier_from_token`, as vLLM serves
Qwen3-Reranker) has a `Classifier`: a request with task "classify" gets its head's logits at the last
token instead of the hidden state; `activate` turns them into the scores and probabilities the server
answers with.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from typing import Any

from pagellm.core.errors import ConfigError
from pagellm.core.json_setting import json_setting

POOLING_TYPES = ("LAST", "MEAN", "CLS")
POOLING_TASKS = ("embed", "classify")
_ST_MODES = {  # sentence-transformers' Pooling config key -> pooling type
    "pooling_mode_lasttoken": "LAST",
    "pooling_mode_mean_tokens": "MEAN",
    "pooling_mode_cls_token": "CLS",
}
_ST_UNSUPPORTED = (
    "pooling_mode_max_tokens",
    "pooling_mode_mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens",
)


@dataclass
class PoolingParams:
    """One embedding request's options (vLLM's PoolingParams).

    `dimensions`: keep the first this many values (Matryoshka models only: those whose config says
    `matryoshka_dimensions` or `is_matryoshka`), before normalising. `normalize`: L2-normalise; None takes
    the model's (`pooler_config` or its sentence-transformers files). `pooling_type`: LAST, MEAN or CLS;
    None takes the model's."""

    dimensions: int | None = None
    normalize: bool | None = None
    pooling_type: str | None = None
    task: str = "embed"  # embed: the pooled hidden state; classify: the classification head's logits
    classifier: Classifier | None = None  # filled in by `Pooler.resolve` for task "classify"


@dataclass(frozen=True)
class Classifier:
    """A model's classification head, as the engine runs it on the last token's hidden state.

    `labels`: one name per logit. A `*ForSequenceClassification` checkpoint's head is its `score` layer
    (names from `id2label`). With `classifier_from_token` (vLLM's hf_overrides for a causal-LM reranker)
    the logits are the language-model head's for those tokens (`token_ids`, looked up in the tokenizer);
    `two_way` (`is_original_qwen3_reranker`, or `method` "from_2_way_softmax") makes one logit of two
    tokens, the second's minus the first's, whose sigmoid is their softmax's second probability: for
    Qwen3-Reranker's ["no", "yes"] that is the model card's score. `qwen3_reranker`: score prompts are
    written in Qwen3-Reranker's template."""

    labels: tuple[str, ...]
    problem_type: str | None = None
    from_tokens: tuple[str, ...] = ()
    token_ids: tuple[int, ...] = ()
    two_way: bool = False
    qwen3_reranker: bool = False

    @property
    def num_labels(self) -> int:
        return len(self.labels)

    def with_token_ids(self, tokenizer: Any) -> Classifier:
        """`from_tokens` looked up in the tokenizer's vocabulary; ConfigError for one it lacks."""
        if not self.from_tokens:
            return self
        vocab = tokenizer.get_vocab()
        missing = [t for t in self.from_tokens if t not in vocab]
        if missing:
            raise ConfigError(
                f"classifier_from_token: the tokenizer has no token {missing[0]!r}; name tokens of its vocabulary",
                param="hf_overrides",
            )
        return dataclasses.replace(self, token_ids=tuple(vocab[t] for t in self.from_tokens))


def classifier_of(hf_config: Any) -> Classifier | None:
    """The classification head of a `*ForSequenceClassification` config; None for any other model."""
    architectures = list(getattr(hf_config, "architectures", None) or [])
    if not any(a.endswith("ForSequenceClassification") for a in architectures):
        return None
    tokens = tuple(getattr(hf_config, "classifier_from_token", None) or ())
    qwen3 = bool(getattr(hf_config, "is_original_qwen3_reranker", False))
    two_way = qwen3 or getattr(hf_config, "method", None) == "from_2_way_softmax"
    problem_type = getattr(hf_config, "problem_type", None)
    if tokens:
        if two_way and len(tokens) != 2:
            raise ConfigError(
                f"classifier_from_token: a two-way softmax needs two tokens, not {len(tokens)}",
                param="hf_overrides",
            )
        return Classifier(tokens[1:] if two_way else tokens, problem_type, tokens, (), two_way, qwen3)
    id2label = {int(k): str(v) for k, v in (getattr(hf_config, "id2label", None) or {}).items()}
    num_labels = int(getattr(hf_config, "num_labels", len(id2label)))
    labels = tuple(id2label.get(i, f"LABEL_{i}") for i in range(num_labels))
    return Classifier(labels, problem_type, qwen3_reranker=qwen3)


def activate(logits: list[float], problem_type: str | None) -> list[float]:
    """Scores from a head's logits, as transformers' losses read them (and vLLM answers): a regression's
    as they are, a multi-label head's each through a sigmoid, one logit through a sigmoid, several
    through a softmax."""
    if problem_type == "regression":
        return list(logits)
    if problem_type == "multi_label_classification" or len(logits) < 2:
        return [1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x)) for x in logits]
    top = max(logits)
    exps = [math.exp(x - top) for x in logits]
    total = sum(exps)
    return [e / total for e in exps]


@dataclass(frozen=True)
class PoolerConfig:
    """vLLM's `pooler_config`: a field left None comes from the model's files, then the default."""

    pooling_type: str | None = None
    normalize: bool | None = None

    @classmethod
    def parse(cls, value: dict[str, Any] | str | None) -> PoolerConfig:
        value = json_setting(value, "pooler_config", cls, '{"pooling_type": "MEAN"}')
        if value is None:
            return cls()
        pooling_type = value.get("pooling_type")
        if pooling_type is not None:
            pooling_type = check_pooling_type(pooling_type, "pooler_config.pooling_type")
        normalize = value.get("normalize")
        if normalize is not None and not isinstance(normalize, bool):
            raise ConfigError(
                f"pooler_config.normalize: must be true or false, not {normalize!r}", param="pooler_config"
            )
        return cls(pooling_type, normalize)


def check_pooling_type(value: Any, name: str) -> str:
    """`value` as one of POOLING_TYPES (any case), else a ConfigError naming `name`."""
    if isinstance(value, str) and value.upper() in POOLING_TYPES:
        return value.upper()
    raise ConfigError(
        f"{name}: {value!r} is not a pooling type; use one of {', '.join(POOLING_TYPES)}",
        param=name.split(".")[0],
    )


@dataclass(frozen=True)
class Pooler:
    """The engine's resolved pooling: what an embedding request gets unless it says otherwise."""

    pooling_type: str
    normalize: bool
    hidden_size: int
    matryoshka_dimensions: tuple[int, ...] | None = None  # the sizes the model was trained to truncate to
    is_matryoshka: bool = False  # any size up to hidden_size may be asked for
    source: str = "default"  # where pooling_type and normalize came from, for the log
    classifier: Classifier | None = None  # a classification model's head

    def resolve(self, params: PoolingParams) -> PoolingParams:
        """`params` with the engine's choices filled in; ConfigError (naming the field) when it cannot run."""
        if params.task not in POOLING_TASKS:
            raise ConfigError(
                f"task: {params.task!r} is not a pooling task; use one of {', '.join(POOLING_TASKS)}",
                param="task",
            )
        if params.task == "classify":
            return self._resolve_classify(params)
        pooling_type = self.pooling_type
        if params.pooling_type is not None:
            pooling_type = check_pooling_type(params.pooling_type, "pooling_type")
        normalize = self.normalize if params.normalize is None else params.normalize
        d = params.dimensions
        if d is not None:
            if not self.is_matryoshka:
                raise ConfigError(
                    f"dimensions: this model does not support Matryoshka truncation (its config sets neither "
                    f"matryoshka_dimensions nor is_matryoshka); leave dimensions out to get all {self.hidden_size}",
                    param="dimensions",
                )
            if isinstance(d, bool) or not isinstance(d, int) or not 1 <= d <= self.hidden_size:
                raise ConfigError(
                    f"dimensions: must be an integer from 1 to {self.hidden_size}, not {d!r}",
                    param="dimensions",
                )
            if self.matryoshka_dimensions and d not in self.matryoshka_dimensions:
                sizes = ", ".join(map(str, self.matryoshka_dimensions))
                raise ConfigError(
                    f"dimensions: {d} is not one this model was trained for; use one of {sizes}",
                    param="dimensions",
                )
        return PoolingParams(d, normalize, pooling_type)

    def _resolve_classify(self, params: PoolingParams) -> PoolingParams:
        """A classify request: the head's logits at the last token (as transformers computes them), neither
        truncated nor normalised."""
        if self.classifier is None:
            raise ConfigError(
                "this model has no classification head: classification and scores need a "
                "*ForSequenceClassification model (or a reranker given by classifier_from_token)",
                param="model",
            )
        if params.dimensions is not None:
            raise ConfigError("dimensions applies to embeddings, not to classification", param="dimensions")
        return PoolingParams(None, False, "LAST", "classify", self.classifier)


def resolve_pooler(model_dir: str | None, hf_config: Any, override: PoolerConfig) -> Pooler:
    """The pooling for a model: `override`'s fields, else the model's sentence-transformers files, else LAST,
    normalized. ConfigError when the files ask for a pooling pagellm does not do (and no override says)."""
    st_type, st_normalize = _sentence_transformers(model_dir) if model_dir else (None, None)
    sources = []
    pooling_type, normalize = override.pooling_type, override.normalize
    if pooling_type is not None or normalize is not None:
        sources.append("pooler_config")
    if pooling_type is None and st_type is not None:
        if st_type.startswith("unsupported:"):
            raise ConfigError(
                f"the model's sentence-transformers Pooling config asks for {st_type.split(':', 1)[1]}, which "
                f"pagellm does not do; pass pooler_config with a pooling_type of {', '.join(POOLING_TYPES)}"
            )
        pooling_type = st_type
        sources.append("modules.json")
    if normalize is None and st_normalize is not None:
        normalize = st_normalize
        if "modules.json" not in sources:
            sources.append("modules.json")
    hidden = int(getattr(hf_config, "hidden_size", 0) or getattr(hf_config, "n_embd", 0))
    dims = getattr(hf_config, "matryoshka_dimensions", None)
    dims = tuple(int(d) for d in dims) if dims else None
    return Pooler(
        pooling_type=pooling_type or "LAST",
        normalize=True if normalize is None else normalize,
        hidden_size=hidden,
        matryoshka_dimensions=dims,
        is_matryoshka=dims is not None or bool(getattr(hf_config, "is_matryoshka", False)),
        source=" and ".join(sources) or "default",
        classifier=classifier_of(hf_config),
    )


def _sentence_transformers(model_dir: str) -> tuple[str | None, bool | None]:
    """(pooling type, normalize) from a sentence-transformers model's modules.json; (None, None) when it
    has none. A Pooling mode pagellm lacks comes back as "unsupported:<mode>"."""
    path = os.path.join(model_dir, "modules.json")
    if not os.path.isfile(path):
        return None, None
    with open(path) as f:
        modules = json.load(f)
    pooling_type, normalize = None, False
    for module in modules if isinstance(modules, list) else []:
        kind = str(module.get("type", ""))
        if kind.endswith(".Normalize"):
            normalize = True
        elif kind.endswith(".Pooling"):
            config_path = os.path.join(model_dir, module.get("path", ""), "config.json")
            if not os.path.isfile(config_path):
                continue
            with open(config_path) as f:
                config = json.load(f)
            modes = [key for key, value in config.items() if key.startswith("pooling_mode_") and value]
            known = [_ST_MODES[m] for m in modes if m in _ST_MODES]
            other = [m for m in modes if m in _ST_UNSUPPORTED]
            if known and not other and len(known) == 1:
                pooling_type = known[0]
            elif modes:
                pooling_type = "unsupported:" + " + ".join(modes)
    return pooling_type, normalize
