"""GGUF tensor names -> Hugging Face names, for the loader to read a .gguf file as a checkpoint.

gguf's table (`get_tensor_name_map`) lists, per llama.cpp tensor, every module name some model family
uses for it, so it maps an HF name to a GGUF one but not back: the way back needs the names the family's
transformers model has. Building that model (on the meta device) imports transformers' modelling code,
2.2-2.7 s of a first start on two cores, so the families whose files `--quantization gguf` keeps packed
(and Mistral and Mixtral, written as `llama`) have their names written here as patterns (`_FAMILIES`, per
architecture and model type), checked against transformers' model and gguf's table by the tests; any other
pair builds the model once and keeps the table in the cache folder. A pattern stays only where gguf's table
of the architecture maps the HF module back to it; one may still name a tensor a file lacks (a bias, a
dense layer beside experts): the loader looks up the names the file has.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from pagellm.core.errors import ConfigError

_LLAMA = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    "blk.{bid}.attn_norm": "model.layers.{bid}.input_layernorm",
    "blk.{bid}.attn_q": "model.layers.{bid}.self_attn.q_proj",
    "blk.{bid}.attn_k": "model.layers.{bid}.self_attn.k_proj",
    "blk.{bid}.attn_v": "model.layers.{bid}.self_attn.v_proj",
    "blk.{bid}.attn_output": "model.layers.{bid}.self_attn.o_proj",
    "blk.{bid}.attn_q_norm": "model.layers.{bid}.self_attn.q_norm",
    "blk.{bid}.attn_k_norm": "model.layers.{bid}.self_attn.k_norm",
    "blk.{bid}.ffn_norm": "model.layers.{bid}.post_attention_layernorm",
    "blk.{bid}.ffn_gate": "model.layers.{bid}.mlp.gate_proj",
    "blk.{bid}.ffn_up": "model.layers.{bid}.mlp.up_proj",
    "blk.{bid}.ffn_down": "model.layers.{bid}.mlp.down_proj",
}

_MIXTRAL = _LLAMA | {"blk.{bid}.ffn_gate_inp": "model.layers.{bid}.mlp.gate"}

_QWEN_MOE = _LLAMA | {
    "blk.{bid}.ffn_gate_inp": "model.layers.{bid}.mlp.gate",
    "blk.{bid}.ffn_gate_shexp": "model.layers.{bid}.mlp.shared_expert.gate_proj",
    "blk.{bid}.ffn_up_shexp": "model.layers.{bid}.mlp.shared_expert.up_proj",
    "blk.{bid}.ffn_down_shexp": "model.layers.{bid}.mlp.shared_expert.down_proj",
    "blk.{bid}.ffn_gate_inp_shexp": "model.layers.{bid}.mlp.shared_expert_gate",
}

_GEMMA = _LLAMA | {
    "blk.{bid}.post_attention_norm": "model.layers.{bid}.post_attention_layernorm",
    "blk.{bid}.ffn_norm": "model.layers.{bid}.pre_feedforward_layernorm",
    "blk.{bid}.post_ffw_norm": "model.layers.{bid}.post_feedforward_layernorm",
}

_PHI3 = _LLAMA | {
    "blk.{bid}.attn_qkv": "model.layers.{bid}.self_attn.qkv_proj",
    "blk.{bid}.ffn_up": "model.layers.{bid}.mlp.gate_up_proj",
}

_FAMILIES: dict[tuple[str, str], dict[str, str]] = {
    ("llama", "llama"): _LLAMA,
    ("llama", "mistral"): _LLAMA,
    ("llama", "mixtral"): _MIXTRAL,
    ("qwen2", "qwen2"): _LLAMA,
    ("qwen3", "qwen3"): _LLAMA,
    ("qwen2moe", "qwen2_moe"): _QWEN_MOE,
    ("qwen3moe", "qwen3_moe"): _QWEN_MOE,
    ("gemma2", "gemma2"): _GEMMA,
    ("gemma3", "gemma3_text"): _GEMMA,
    ("phi3", "phi3"): _PHI3,
}
"""(llama.cpp architecture, the converted config's model type) -> {GGUF module pattern: HF module pattern};
`{bid}` is the layer's index. A mixture of experts' stacked experts are not here: the reader names them
from the router's module. The model type is part of the key: llama.cpp writes Mistral and Mixtral files as
`llama`, and transformers names their modules by its own classes."""


def gguf_hf_names(architecture: str, hf_config) -> dict[str, str]:
    """GGUF tensor name (`blk.3.attn_q.weight`) -> HF name (`model.layers.3.self_attn.q_proj.weight`) for a
    file of `architecture` whose converted config is `hf_config`."""
    patterns = _FAMILIES.get((architecture, getattr(hf_config, "model_type", None)))
    if patterns is None:
        return _kept_transformers_names(architecture, hf_config)
    table = _gguf_table(architecture, hf_config.num_hidden_layers)
    names = {}
    for layer in range(hf_config.num_hidden_layers):
        for gguf_pattern, hf_pattern in patterns.items():
            if "{bid}" not in gguf_pattern and layer > 0:
                continue
            gguf_module, hf_module = gguf_pattern.format(bid=layer), hf_pattern.format(bid=layer)
            if table.get_name(hf_module) != gguf_module:  # a tensor llama.cpp's architecture does not have
                continue
            for suffix in ("weight", "bias"):
                names[f"{gguf_module}.{suffix}"] = f"{hf_module}.{suffix}"
    return names


def _gguf_table(architecture: str, layers: int) -> Any:
    """gguf's TensorNameMap of `architecture` (HF module name -> GGUF module name)."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    arch = next((key for key, name in MODEL_ARCH_NAMES.items() if name == architecture), None)
    if arch is None:
        raise ConfigError(f"GGUF architecture {architecture!r} is unknown to the installed gguf package")
    return get_tensor_name_map(arch, layers)


def _kept_transformers_names(architecture: str, hf_config) -> dict[str, str]:
    """`transformers_names`, kept in the cache folder (`gguf/names-<key>.json`) for the next start. Keyed
    by what the table depends on: the architecture, the config, and the gguf and transformers versions."""
    import hashlib
    import json

    import gguf
    import transformers

    from pagellm.core.paths import cache_dir

    facts = json.dumps(
        [
            architecture,
            hf_config.to_json_string(use_diff=False),
            transformers.__version__,
            _gguf_version(gguf),
        ]
    )
    path = Path(cache_dir()) / "gguf" / f"names-{hashlib.sha256(facts.encode()).hexdigest()[:16]}.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        pass
    names = transformers_names(architecture, hf_config)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(names))
    tmp.replace(path)
    return names


def _gguf_version(gguf: Any) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("gguf")
    except PackageNotFoundError:
        return getattr(gguf, "__file__", "")


def transformers_names(architecture: str, hf_config) -> dict[str, str]:
    """GGUF tensor name -> HF name for the tensors transformers' model of `hf_config` has, through gguf's
    table of HF module names per llama.cpp architecture (transformers' own `get_gguf_hf_weights_map` does
    the same but walks every submodule: seconds)."""
    from transformers import AutoModelForCausalLM

    table = _gguf_table(architecture, hf_config.num_hidden_layers)
    with torch.device("meta"):
        hf_names = AutoModelForCausalLM.from_config(hf_config).state_dict()
    names = {}
    for hf_name in hf_names:
        module, _, suffix = hf_name.rpartition(".")
        gguf_module = table.get_name(module)
        if gguf_module is not None:
            names[f"{gguf_module}.{suffix}"] = hf_name
    return names
