"""IBM Granite MoE (`GraniteMoeForCausalLM`: granite-3.0/3.1 -1b-a400m and -3b-a800m): Granite's dense decoder
(granite.py: embeddings times `embedding_multiplier`, each block's output times `residual_multiplier`,
`attention_multiplier` as the softmax scale, logits divided by `logits_scaling`) with routed experts in place
of the MLP in every layer: the top `num_experts_per_tok` router logits, softmaxed over those k only, and
experts `intermediate_size` wide. No shared expert (that is `GraniteMoeSharedForCausalLM`), no dense layers.

The checkpoints keep Granite's own names, as Granite 4.0-H's experts (granitemoehybrid.py): a
`block_sparse_moe` with the router's `router.layer` and each layer's experts stacked in two tensors,
`input_linear` [E, 2I, H] (each expert's gate rows, then its up rows) and `output_linear` [E, H, I].

Tensor parallelism as Qwen3-MoE: attention by heads, the experts by width or, with --enable-expert-parallel,
whole. A rank reads a layer's stacked expert tensor whole (one layer at a time) and keeps its part.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from pagellm.models.base import ModelInit
from pagellm.models.granite import GraniteDecoderLayer, GraniteForCausalLM, GraniteModel
from pagellm.models.layers.fused_moe.block import SparseMoeBlock
from pagellm.models.layers.fused_moe.loading import copy_weights_with_experts
from pagellm.models.layers.fused_moe.routing import SOFTMAX_AFTER_TOPK, Routing
from pagellm.models.llama import STACKED
from pagellm.models.loader import CheckpointSlice


class GraniteMoeDecoderLayer(GraniteDecoderLayer):
    def build_mlp(self, init: ModelInit, layer_idx: int) -> nn.Module:
        c = init.hf_config
        routing = Routing(c.num_experts_per_tok, SOFTMAX_AFTER_TOPK)
        return SparseMoeBlock(init, routing, c.intermediate_size)


class GraniteMoeModel(GraniteModel):
    layer_class = GraniteMoeDecoderLayer


class GraniteMoeForCausalLM(GraniteForCausalLM):
    model_class = GraniteMoeModel

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return copy_weights_with_experts(self, split_granite_experts(weights), STACKED, self._adapt)

    def _adapt(self, name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        return super()._adapt(name.replace(".block_sparse_moe.", ".mlp."), tensor)


def split_granite_experts(
    weights: Iterable[tuple[str, torch.Tensor | CheckpointSlice]],
) -> Iterator[tuple[str, torch.Tensor | CheckpointSlice]]:
    """Granite's MoE names onto `SparseMoeBlock`'s: `router.layer` is its `gate`; the stacked `input_linear`
    and `output_linear` become each expert's gate, up and down projections (views of the stacked tensor),
    which `FusedMoE` reads per expert."""
    for name, tensor in weights:
        if name.endswith(".block_sparse_moe.router.layer.weight"):
            yield name.replace(".router.layer.", ".gate."), tensor
        elif name.endswith(
            (".block_sparse_moe.input_linear.weight", ".block_sparse_moe.output_linear.weight")
        ):
            prefix, _, kind = name.rpartition(".block_sparse_moe.")
            stacked = tensor.load() if isinstance(tensor, CheckpointSlice) else tensor
            experts = f"{prefix}.block_sparse_moe.experts"
            for e, expert in enumerate(stacked):
                if kind.startswith("input_linear"):
                    gate, up = expert.chunk(2)
                    yield f"{experts}.{e}.gate_proj.weight", gate
                    yield f"{experts}.{e}.up_proj.weight", up
                else:
                    yield f"{experts}.{e}.down_proj.weight", expert
        else:
            yield name, tensor
