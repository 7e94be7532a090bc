"""The config fields of a GGUF file that transformers' GGUF reader drops, filled back in per architecture.

transformers maps a fixed list of GGUF keys per architecture onto the Hugging Face config and leaves every
other field at the config class's default. For some real files that default is not the model's: Gemma 2
27B's and Gemma 3 27B's attention scale, the linear rope scaling of Gemma 3 4B and larger on their global
layers, Phi-4-mini's partial rotary, the LongRoPE of Phi-3-128k, Phi-3.5-mini and Phi-4-mini. The rules
below read those fields from the file and, for the one field llama.cpp has no key for but derives (Gemma's
attention scale), derive it as llama.cpp does, so a GGUF file runs as the checkpoint it was converted from.

Mixtures of experts: transformers reads a Qwen3-MoE or Qwen2-MoE file's expert count and experts per token
but not the experts' width, Qwen2-MoE's shared expert width, or whether the top-k weights are renormalised
(llama.cpp fixes that per architecture: Qwen3-MoE yes, Qwen2-MoE no); it reads a Mixtral file (`llama`
with experts) as a dense Llama. The rules below fill the widths and the renormalisation, and make a `llama`
file with experts a Mixtral config.

What llama.cpp fixes in its code and no file states stays at transformers' defaults, which are the same
values: Gemma 2's alternating window layers, Gemma 3's five local layers per global one and its local rope
base (10000).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import numpy as np

from pagellm.core.errors import ConfigError


class _Metadata:
    """One GGUF file's keys of its own architecture (`<arch>.<key>`) and its small tensors, with float32
    values as the shortest decimals that read back as the same float32: the numbers the original
    config.json had (1.1, not 1.100000023841858)."""

    def __init__(self, reader: Any):
        self.reader = reader
        self.arch: str = reader.get_field("general.architecture").contents()
        self.tensors = {tensor.name: tensor for tensor in reader.tensors}

    def get(self, key: str) -> Any:
        field = self.reader.get_field(f"{self.arch}.{key}")
        if field is None:
            return None
        value = field.contents()
        return float(str(np.float32(value))) if isinstance(value, float) else value

    def floats(self, tensor_name: str) -> list[float] | None:
        from gguf import dequantize

        tensor = self.tensors.get(tensor_name)
        if tensor is None:
            return None
        return [float(str(v)) for v in dequantize(tensor.data, tensor.tensor_type).astype(np.float32).ravel()]


Fields = dict[str, Any]
Rule = Callable[[_Metadata, Fields], Fields]


def _stated(table: dict[str, str]) -> Rule:
    """GGUF keys (without the architecture prefix) copied into config fields as they are."""

    def rule(meta: _Metadata, fields: Fields) -> Fields:
        return {field: value for key, field in table.items() if (value := meta.get(key)) is not None}

    return rule


def _gemma_attention_scale(layers_of_27b: int) -> Rule:
    """`query_pre_attn_scalar`, which no file states: llama.cpp takes hidden size / heads for the 27B model
    (told by its layer count) and the head size for every other, as gemma_pytorch's configs have it."""

    def rule(meta: _Metadata, fields: Fields) -> Fields:
        if fields["num_hidden_layers"] == layers_of_27b:
            return {"query_pre_attn_scalar": fields["hidden_size"] // fields["num_attention_heads"]}
        return {"query_pre_attn_scalar": fields["head_dim"]}

    return rule


def _global_rope_scaling(meta: _Metadata, fields: Fields) -> Fields:
    """Gemma 3's rope scaling, which applies to its global (full-attention) layers only."""
    kind = meta.get("rope.scaling.type")
    if kind in (None, "none"):
        return {}
    if kind != "linear":
        raise ConfigError(f"GGUF {meta.arch} file: rope scaling {kind!r} is not supported (linear is)")
    rope = copy.deepcopy(fields["rope_parameters"])
    rope["full_attention"].update(rope_type="linear", factor=meta.get("rope.scaling.factor"))
    return {"rope_parameters": rope}


def _phi3_rope(meta: _Metadata, fields: Fields) -> Fields:
    """Phi-3's rotated width of a head (Phi-4-mini rotates 3/4), its original context length and, where the
    file has the factors (tensors `rope_factors_long/short`), LongRoPE. The file's LongRoPE attention factor
    is not read: llama.cpp's converter writes the one transformers computes from the two context lengths."""
    rope = dict(fields["rope_parameters"])
    found: Fields = {"rope_parameters": rope}
    dims = meta.get("rope.dimension_count")
    if dims is not None:
        rope["partial_rotary_factor"] = dims / (fields["hidden_size"] // fields["num_attention_heads"])
    original = meta.get("rope.scaling.original_context_length")
    if original is not None:
        found["original_max_position_embeddings"] = original
    long, short = meta.floats("rope_factors_long.weight"), meta.floats("rope_factors_short.weight")
    if long is not None and short is not None:
        rope.update(
            rope_type="longrope",
            long_factor=long,
            short_factor=short,
            original_max_position_embeddings=original or fields["original_max_position_embeddings"],
        )
    return found


def _phi3_window(meta: _Metadata, fields: Fields) -> Fields:
    """Phi-3's window, 0 in the file for none. llama.cpp runs Phi-3 without it (its converters have been
    unreliable about it); the checkpoint the file came from has it, and so does this config."""
    window = meta.get("attention.sliding_window")
    return {} if window is None else {"sliding_window": window or None}


def _topk_renormalised(fixed: bool) -> Rule:
    """`norm_topk_prob`: the file's `expert_weights_norm` where it states one, else what llama.cpp fixes for
    the architecture (it renormalises Qwen3-MoE's top-k weights, not Qwen2-MoE's)."""

    def rule(meta: _Metadata, fields: Fields) -> Fields:
        stated = meta.get("expert_weights_norm")
        return {"norm_topk_prob": fixed if stated is None else bool(stated)}

    return rule


def _mixtral(meta: _Metadata, fields: Fields) -> Fields:
    """A `llama` file with experts is Mixtral: llama.cpp writes Mixtral as Llama plus an expert count, and
    its `feed_forward_length` is then the experts' width, which Mixtral's config keeps in intermediate_size."""
    experts = meta.get("expert_count")
    if not experts:
        return {}
    return {
        "model_type": "mixtral",
        "num_local_experts": experts,
        "num_experts_per_tok": meta.get("expert_used_count"),
    }


def _starcoder2(meta: _Metadata, fields: Fields) -> Fields:
    """Refused: transformers' reader of a `starcoder2` file drops its rope base (`rope.freq_base`: 1e5 to 1e6
    in the released models, against the config's default 10000) and its sliding window, so the file would
    run as another model than the checkpoint it came from; no rule here reads them back (none is tested)."""
    raise ConfigError(
        "StarCoder2 GGUF files are not supported (transformers' GGUF reader drops the rope base and the "
        "sliding window); run the safetensors checkpoint (--quantization quantizes it at load)"
    )


def _minimax_m2(meta: _Metadata, fields: Fields) -> Fields:
    """Refused: transformers reads `minimax-m2` files, but no test checks pagellm on one against the
    checkpoint it came from (pagellm.bench.gguf_convert writes none), and the reader turns some fields into
    other values than config.json's (`expert_gating_func` an enum number for `scoring_func`)."""
    raise ConfigError(
        "MiniMax-M2 GGUF files are not supported (no conversion of one is checked against transformers); "
        "run the safetensors checkpoint"
    )


def _gemma4(meta: _Metadata, fields: Fields) -> Fields:
    """Refused: transformers reads `gemma4` files, but no test checks pagellm on one against the checkpoint
    it came from (pagellm.bench.gguf_convert writes none), and Gemma 4's config is per layer (head sizes and
    KV heads of the full layers, shared KV, per-layer inputs), which no rule here checks is read back."""
    raise ConfigError(
        "Gemma 4 GGUF files are not supported (no conversion of one is checked against transformers); run "
        "the safetensors checkpoint"
    )


def _lfm2(meta: _Metadata, fields: Fields) -> Fields:
    """Refused: transformers reads `lfm2` files (deriving the conv layers from the per-layer KV head counts),
    but no test checks pagellm on one against the checkpoint it came from (pagellm.bench.gguf_convert writes
    none)."""
    raise ConfigError(
        "LFM2 GGUF files are not supported (no conversion of one is checked against transformers); run the "
        "safetensors checkpoint"
    )


_QWEN_MOE_WIDTHS = {
    "expert_feed_forward_length": "moe_intermediate_size",
    "expert_shared_feed_forward_length": "shared_expert_intermediate_size",
}

_RULES: dict[str, tuple[Rule, ...]] = {
    "gemma2": (
        _stated(
            {
                "attn_logit_softcapping": "attn_logit_softcapping",
                "final_logit_softcapping": "final_logit_softcapping",
            }
        ),
        _gemma_attention_scale(layers_of_27b=46),
    ),
    "gemma3": (
        _stated({"final_logit_softcapping": "final_logit_softcapping"}),
        _gemma_attention_scale(layers_of_27b=62),
        _global_rope_scaling,
    ),
    "phi3": (_phi3_rope, _phi3_window),
    "qwen3moe": (_stated(_QWEN_MOE_WIDTHS), _topk_renormalised(fixed=True)),
    "qwen2moe": (_stated(_QWEN_MOE_WIDTHS), _topk_renormalised(fixed=False)),
    "llama": (_mixtral,),
    "starcoder2": (_starcoder2,),
    "minimax-m2": (_minimax_m2,),
    "gemma4": (_gemma4,),
    "lfm2": (_lfm2,),
}


def fill_gguf_config(config: Any, reader: Any) -> Any:
    """`config` (transformers' reading of the GGUF file `reader` has open) with the fields the reader drops
    set from the file; rebuilt through its class, so rope parameters are validated as a checkpoint's are.
    A rule that changes `model_type` (Mixtral) rebuilds it through that type's class, from the fields the
    class has."""
    from transformers import CONFIG_MAPPING

    meta = _Metadata(reader)
    rules = _RULES.get(meta.arch)
    if rules is None:
        return config
    fields = config.to_dict()
    for rule in rules:
        fields.update(rule(meta, fields))
    if fields["model_type"] == config.model_type:
        return type(config).from_dict(fields)
    config_class = CONFIG_MAPPING[fields["model_type"]]
    known = config_class().to_dict().keys()
    return config_class.from_dict({key: value for key, value in fields.items() if key in known})
