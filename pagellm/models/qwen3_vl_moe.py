"""Qwen3-VL-MoE (`Qwen3VLMoeForConditionalGeneration`, e.g. Qwen3-VL-30B-A3B): Qwen3-VL (models/qwen3_vl.py:
the vision encoder, deepstack, the interleaved multimodal rope, images in the prompt) whose decoder has
Qwen3-MoE's routed experts (models/qwen3_moe.py) in place of the MLP. What differs, as transformers 5's
modelling has it:

- The router always renormalises its top k: the config has no `norm_topk_prob`, and one a config.json
  carries is ignored, as transformers ignores it.
- The checkpoint holds a layer's experts fused: `experts.gate_up_proj` (gate rows, then up rows) and
  `experts.down_proj`. The released checkpoints store them as x @ W multiplies, [E, H, 2I] and [E, I, H];
  transformers 5's `save_pretrained` writes its modules' own [E, 2I, H] and [E, H, I]. transformers tells
  the two apart by shape, taking a tensor already of its module's shape as it is (also where H == 2I or
  H == I give both layouts one shape); `per_expert_weights` does the same and cuts them into the per-expert
  tensors `FusedMoE` loads.
- `mlp_only_layers` and `decoder_sparse_step` keep some layers dense (`is_sparse_layer`), as in Qwen3-MoE.

As Qwen3-VL, it runs without tensor or pipeline parallelism (the vision encoder has no split).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from pagellm.core.errors import ConfigError
from pagellm.models.base import ModelInit
from pagellm.models.layers.fused_moe.block import SparseMoeBlock, expert_count, is_sparse_layer
from pagellm.models.layers.fused_moe.routing import Routing
from pagellm.models.llama import LlamaMLP
from pagellm.models.loader import CheckpointSlice
from pagellm.models.qwen3_moe import Qwen3MoeForCausalLM
from pagellm.models.qwen3_vl import Qwen3VLDecoderLayer, Qwen3VLForConditionalGeneration
from pagellm.models.qwen_vl import QwenVLLanguageModel


class Qwen3VLMoeDecoderLayer(Qwen3VLDecoderLayer):
    """Qwen3-VL's layer (deepstack rows added after it) with routed experts on the sparse layers."""

    def build_mlp(self, init: ModelInit, layer_idx: int) -> nn.Module:
        c = init.hf_config
        if not is_sparse_layer(c, layer_idx):
            return LlamaMLP(init)
        return SparseMoeBlock(init, Routing(c.num_experts_per_tok, renormalize=True), c.moe_intermediate_size)


class Qwen3VLMoeLanguageModel(QwenVLLanguageModel):
    layer_class = Qwen3VLMoeDecoderLayer


class Qwen3VLMoeForConditionalGeneration(Qwen3VLForConditionalGeneration, Qwen3MoeForCausalLM):
    """Qwen3-VL with the decoder above; Qwen3-MoE after it in the bases gives the loader that hands the
    experts' tensors to their `FusedMoE` layers (`QwenVL.load_weights` calls it for the decoder's)."""

    model_class = Qwen3VLMoeLanguageModel

    def __init__(self, init: ModelInit):
        super().__init__(init)
        c = init.hf_config
        self.expert_shape = (expert_count(c), c.hidden_size, c.moe_intermediate_size)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(per_expert_weights(weights, *self.expert_shape))


def per_expert_weights(
    weights: Iterable[tuple[str, torch.Tensor]], num_experts: int, hidden: int, width: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with each fused `<layer>.experts.gate_up_proj` and `.down_proj` cut into
    `<layer>.experts.{e}.gate_proj/up_proj/down_proj.weight` [out, in] (views, copied as they load)."""
    for name, tensor in weights:
        prefix, _, kind = name.rpartition(".")
        if not prefix.endswith(".experts") or kind not in ("gate_up_proj", "down_proj"):
            yield name, tensor
            continue
        out, into = (2 * width, hidden) if kind == "gate_up_proj" else (hidden, width)
        t = tensor.load() if isinstance(tensor, CheckpointSlice) else tensor
        if tuple(t.shape) == (num_experts, into, out) != (num_experts, out, into):  # x @ W, as released
            t = t.transpose(1, 2)
        elif tuple(t.shape) != (num_experts, out, into):
            raise ConfigError(
                f"checkpoint tensor {name} is {tuple(t.shape)}; {num_experts} experts of width {width} over "
                f"hidden size {hidden} need {(num_experts, out, into)} or {(num_experts, into, out)}"
            )
        for e in range(num_experts):
            if kind == "down_proj":
                yield f"{prefix}.{e}.down_proj.weight", t[e]
            else:
                yield f"{prefix}.{e}.gate_proj.weight", t[e, :width]
                yield f"{prefix}.{e}.up_proj.weight", t[e, width:]
