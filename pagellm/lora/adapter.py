"""Reading a PEFT LoRA adapter (`adapter_config.json` + `adapter_model.safetensors`) into per-module A and
B matrices, refusing what pagellm does not run."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

import torch

from pagellm.core.errors import ConfigError

# the projections an adapter may target: Hugging Face module name -> (pagellm's layer, shard in it)
TARGETS = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "o_proj": ("o_proj", 0),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", 0),
}


@dataclass
class LoRAAdapter:
    rank: int
    scaling: float  # lora_alpha / rank, or lora_alpha / sqrt(rank) with rslora
    # pagellm module path ("model.layers.0.self_attn.qkv_proj") -> {shard: (A [rank, in], B [out_shard, rank])}
    weights: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]]


def load_adapter(path: str, max_rank: int) -> LoRAAdapter:
    config_file = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(config_file):
        raise ConfigError(f"LoRA adapter {path}: no adapter_config.json (a PEFT adapter directory is needed)")
    with open(config_file) as f:
        config = json.load(f)
    rank = int(config.get("r", 0))
    problems = []
    if config.get("peft_type", "LORA") != "LORA":
        problems.append(f"peft_type {config.get('peft_type')} (only LORA)")
    if config.get("use_dora"):
        problems.append("DoRA (use_dora)")
    if config.get("modules_to_save"):
        problems.append(f"modules_to_save {config['modules_to_save']}")
    if config.get("bias", "none") != "none":
        problems.append(f"bias {config['bias']!r} (only 'none')")
    if not 1 <= rank <= max_rank:
        problems.append(f"rank {rank} (max_lora_rank is {max_rank})")
    if problems:
        raise ConfigError(f"LoRA adapter {path}: not supported: {'; '.join(problems)}")
    alpha = float(config.get("lora_alpha", rank))
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    tensors = _read_tensors(path)
    weights: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
    for key, a in tensors.items():
        if not key.endswith(".lora_A.weight"):
            continue
        module = key.removesuffix(".lora_A.weight").removeprefix("base_model.model.")
        leaf = module.rsplit(".", 1)[-1]
        if leaf not in TARGETS:
            raise ConfigError(
                f"LoRA adapter {path}: targets {module}; supported targets: {', '.join(TARGETS)}"
            )
        b = tensors.get(key.replace(".lora_A.", ".lora_B."))
        if b is None:
            raise ConfigError(f"LoRA adapter {path}: {module} has lora_A but no lora_B")
        layer, shard = TARGETS[leaf]
        weights.setdefault(f"{module.rsplit('.', 1)[0]}.{layer}", {})[shard] = (a, b)
    if not weights:
        raise ConfigError(f"LoRA adapter {path}: no lora_A/lora_B weights found")
    return LoRAAdapter(rank, scaling, weights)


def _read_tensors(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    file = os.path.join(path, "adapter_model.safetensors")
    if os.path.isfile(file):
        return load_file(file)
    legacy = os.path.join(path, "adapter_model.bin")
    if os.path.isfile(legacy):
        return torch.load(legacy, map_location="cpu", weights_only=True)
    raise ConfigError(f"LoRA adapter {path}: no adapter_model.safetensors")
