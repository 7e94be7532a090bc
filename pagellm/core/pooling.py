"""Embeddings (`runner="pooling"`): how a prompt's final hidden states become one vector.

`PoolerConfig` is vLLM's `pooler_config` (`pooling_type`: LAST, MEAN or CLS; `normalize`); `resolve_pooler`
fills what it leaves out from the model's sentence-transformers files (`modules.json`, its Pooling module's
`config.json`, a Normalize module) and else uses the default for decoder models, LAST and normalized.
`PoolingParams` is what one embedding request asks for (`dimensions`, `normalize`), as in vLLM.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from pagellm.core.errors import ConfigError
from pagellm.core.json_setting import json_setting

POOLING_TYPES = ("LAST", "MEAN", "CLS")
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

    def resolve(self, params: PoolingParams) -> PoolingParams:
        """`params` with the engine's choices filled in; ConfigError (naming the field) when it cannot run."""
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
