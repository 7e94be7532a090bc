"""What every model class gets at construction, and the interface the model runner relies on."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.core.attention import AttentionSpec
from pagellm.core.native_decode import DenseDecoder
from pagellm.core.platform import PackedLinear
from pagellm.distributed import Group
from pagellm.models.context import ModelInit as ModelInit  # part of this interface; defined below the layers
from pagellm.models.layers.attention import Attention
from pagellm.models.layers.recurrent import RecurrentLayer


def head_size(hf_config: Any) -> int:
    """Width of one attention head: the config's `head_dim` where it states one (Qwen3), else
    hidden_size / num_attention_heads."""
    return getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads


def rank_heads(spec: AttentionSpec, tp: Group) -> AttentionSpec:
    """The spec of one tensor-parallel rank: its share of the query heads, and of the KV heads (one each,
    replicated, when there are fewer KV heads than ranks)."""
    if tp.size == 1:
        return spec
    return dataclasses.replace(
        spec, num_heads=spec.num_heads // tp.size, num_kv_heads=max(1, spec.num_kv_heads // tp.size)
    )


def stage_layers(num_layers: int, pp: Group) -> range:
    """The decoder layers of pipeline stage `pp.rank`: an even split, earlier stages taking the remainder."""
    base, extra = divmod(num_layers, pp.size)
    start = pp.rank * base + min(pp.rank, extra)
    return range(start, start + base + (pp.rank < extra))


class CausalLM(nn.Module):
    """The model interface. Subclasses build layers in __init__(init: ModelInit) and implement:

    - forward(input_ids [T] int64, positions [T] int64) -> hidden states [T, hidden]
    - compute_logits(hidden [N, hidden]) -> logits [N, vocab] in the model's dtype (the sampler widens
      them to float32 where it computes; a greedy argmax needs no copy)
    - load_weights(weights: iterable of (Hugging Face tensor name, tensor))
    - attention_spec(hf_config, dtype, block_size, layer_idx) -> the spec of attention layer layer_idx
    Attention layers are `pagellm.models.layers.attention.Attention` with layer_idx 0..L-1; a hybrid model's
    recurrent layers are `pagellm.models.layers.recurrent.RecurrentLayer`s with state_idx 0..S-1.
    `ModelInit` is defined in `pagellm.models.context`, below the layers that take it too, and named here.
    """

    supports_parallel: bool = False
    """Whether the class builds its layers for `ModelInit.parallel` (tensor and pipeline parallelism)."""

    unsplit_layers: str = "its layers are not built on the shared parallel layers"
    """Where `supports_parallel` is False: the layers that cannot split, named in the refusal."""

    reads_quantization: tuple[str, ...] = ()
    """`quantization_config.quant_method` values the class's own weight loading reads (GPT-OSS: its MXFP4
    experts, dequantized at load); no `QuantMethod` is selected for those checkpoints."""

    float_modules: tuple[str, ...] = ()
    """Checkpoint modules (the last part of their names) whose weights the class reads as plain floats even
    from a quantized checkpoint, as a method that translates the checkpoint hands them on
    (`QuantMethod.checkpoint_weights`: block-wise fp8 dequantizes them). DeepSeek: kv_b_proj, which MLA
    reads per head."""

    packed_lm_head: PackedLinear | None = None
    """The output projection repacked by the platform (`Platform.pack_linear`, set by the model runner)."""

    def dense_decoder(self) -> DenseDecoder | str:
        """The model described for a platform's native decode step (`core/native_decode.py`), or why it
        cannot be: only the plain Llama decoder can (llama.py)."""
        return f"{type(self).__name__} is not the plain Llama decoder"

    def project_logits(self, hidden: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        """Logits hidden @ weight^T in the model's dtype, through `packed_lm_head` when the runner set one
        (then `weight` may be None: an untied lm_head keeps only the packed copy). Not widened here: for
        greedy steps the argmax of bf16 logits is the same token, and skipping the float32 copy saved
        4.0 -> 1.7 ms (32 rows) and 17.4 -> 3.6 ms (64 rows) of model M's 151,936-token vocabulary."""
        packed = self.packed_lm_head
        if packed is not None:
            return packed.matmul(hidden, packed.weight, None)
        return F.linear(hidden, weight)

    @staticmethod
    def attention_spec(hf_config: Any, dtype: torch.dtype, block_size: int, layer_idx: int) -> AttentionSpec:
        """The spec attention layer `layer_idx` is built with. The engine selects the backend from it before
        the model exists, so the model's layers must build theirs with this same function."""
        raise NotImplementedError

    @classmethod
    def selection_spec(cls, hf_config: Any, dtype: torch.dtype, block_size: int) -> AttentionSpec:
        """The spec the attention backend is selected for: the most demanding layer's (a sliding window, a
        soft-cap, sinks, a latent KV layout, bidirectional spans or chunked local attention, which not every
        backend has), else the first layer's."""
        specs = [
            cls.attention_spec(hf_config, dtype, block_size, i)
            for i in range(cls.num_attention_layers(hf_config))
        ]
        return max(
            specs,
            key=lambda s: (
                s.sliding_window is not None,
                s.logits_soft_cap is not None,
                s.has_sinks,
                s.latent_kv,
                s.bidirectional_spans,
                s.attention_chunk is not None,
            ),
        )

    @staticmethod
    def num_attention_layers(hf_config: Any) -> int:
        """Attention layers (with a KV cache): every layer, unless a hybrid model's recurrent layers take
        some places (those models number their attention layers 0..L-1 among themselves)."""
        return hf_config.num_hidden_layers

    def attention_layers(self) -> list[Attention]:
        return sorted((m for m in self.modules() if isinstance(m, Attention)), key=lambda m: m.layer_idx)

    def state_layers(self) -> list[RecurrentLayer]:
        """The layers with per-sequence recurrent state (core/state.py), by state_idx; none in most models."""
        return sorted((m for m in self.modules() if isinstance(m, RecurrentLayer)), key=lambda m: m.state_idx)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        raise NotImplementedError
