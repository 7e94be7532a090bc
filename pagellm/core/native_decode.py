"""What a platform's native decode step is given: a dense decoder's weights described without its modules.

At one request a decode step reads every weight once, and on a CPU what lies between those reads (per-op
dispatch, small elementwise kernels, an OpenMP region per op) costs a fifth of the step. A platform may
run such a step in one native call instead (`Platform.native_decode_step`); the model says what it is
made of (`CausalLM.dense_decoder`), in these plain terms, so neither imports the other.

The shape described is the Llama decoder: embedding, then per layer h + attention(rms_norm(h)) and
h + down(act(gate) * up)(rms_norm(h)) with the residual stream kept apart (`RMSNorm.add_and_norm`),
neox rotary over whole heads, optional per-head q/k RMSNorm (Qwen3), optional biases, a final RMSNorm;
or routed experts in place of a layer's MLP (Qwen3-MoE). An EAGLE-3 draft head (`DraftHead`) is that
decoder's one layer with two inputs, run the same way (`Platform.native_head_step`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch


@dataclass
class Projection:
    """One linear layer as loaded: the platform's packed weight and its matmul (`Platform.pack_linear`),
    the plain weight where it kept none, or a quantized one's parts in place (`QuantMethod.native_blocks`:
    GGUF blocks with their GGML type ids; `weight` and `matmul` None then)."""

    weight: torch.Tensor | None
    matmul: Callable[..., torch.Tensor] | None
    bias: torch.Tensor | None
    out_features: int
    in_features: int
    blocks: list[tuple[torch.Tensor, int]] | None = None


@dataclass
class Experts:
    """A layer's routed experts in place of its MLP (Qwen3-MoE): the router's logits, softmax over the
    experts in float32, the `top_k` best, divided by their sum where `renormalize`; then the experts as
    the platform packed them (`PackedMoE.run`, which the platform recognises as its own)."""

    router: Projection
    top_k: int
    renormalize: bool
    kernel: Any


@dataclass
class DenseLayer:
    input_norm: torch.Tensor
    post_attention_norm: torch.Tensor
    qkv: Projection  # q, k, v heads in that order
    o: Projection
    gate_up: Projection | None  # gate, then up; None where `experts` replace the MLP
    down: Projection | None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    experts: Experts | None = None


@dataclass
class DenseDecoder:
    embedding: torch.Tensor  # [vocab, hidden], or GGUF rows (uint8 [vocab, bytes]) of `embedding_type`
    final_norm: torch.Tensor
    inv_freq: torch.Tensor  # float32 [head_size // 2]
    rope_scaling: float  # cos and sin are multiplied by it (yarn's attention factor; 1 otherwise)
    eps: float  # every RMSNorm's
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    intermediate_size: int  # the dense MLPs' (0 where every layer has experts)
    activation: str  # the gated MLP's (the config's hidden_act)
    layers: Sequence[DenseLayer]
    embedding_type: int | None = None  # the GGML type of a GGUF embedding's rows
    dtype: torch.dtype = torch.bfloat16  # the activations'


@dataclass
class DraftHead:
    """An EAGLE-3 head (`spec_decode/eagle_head.py`): one decoder layer whose q/k/v read
    [rms_norm(embedding of the token); rms_norm(hidden)] (`input_norm`, `hidden_norm`; `qkv` has
    2 * hidden_size inputs) and whose residual is the hidden state (normed first where
    `norm_before_residual`); then the final norm, and `lm_head` over the draft vocabulary, whose argmax
    `d2t` maps to the target's (target id = draft id + d2t[id])."""

    embedding: torch.Tensor  # as DenseDecoder's (the target's, or the head's own)
    embedding_type: int | None
    layer: DenseLayer  # input_norm: the embeddings'; no q/k norms, no experts
    hidden_norm: torch.Tensor
    norm_before_residual: bool
    final_norm: torch.Tensor
    lm_head: Projection
    d2t: torch.Tensor  # int64 [draft vocabulary]
    inv_freq: torch.Tensor
    rope_scaling: float
    eps: float
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    intermediate_size: int
    activation: str
    dtype: torch.dtype = torch.bfloat16


@dataclass
class HeadRows:
    """The rows of one pass of a draft head: `tokens` at `positions`, their keys and values stored at
    `slots`, `block_tables` as `NativeDecodeStep`'s (rows of one request at consecutive positions attend
    causally), each reading `hidden` [rows, hidden_size]; and the rows whose drafts are wanted (`picks`,
    indices into the rows)."""

    tokens: np.ndarray
    positions: np.ndarray
    slots: np.ndarray
    block_tables: np.ndarray
    hidden: torch.Tensor
    picks: np.ndarray


class NativeHeadStep(Protocol):
    """A platform's pass of a draft head over its own KV cache: up to `max_rows` rows."""

    max_rows: int

    def __call__(self, rows: HeadRows) -> tuple[torch.Tensor, torch.Tensor]:
        """For each picked row: the draft (the target's token id) and the head's output before its final
        norm (what the next pass reads)."""
        ...


class NativeDecodeStep(Protocol):
    """A platform's decode step over the model's KV cache: up to `max_rows` rows, a row per request or a
    request's token and the drafts after it (each row attending to the rows before it of its request)."""

    max_rows: int
    # the layers whose incoming residual stream (h + residual) a call also reports in `aux`, for a proposer
    # that reads them (EAGLE-3); set by the runner
    aux_layers: tuple[int, ...]
    aux: torch.Tensor | None  # the last call's, [rows, len(aux_layers) * hidden], layers in that order

    def __call__(
        self, tokens: np.ndarray, positions: np.ndarray, slots: np.ndarray, block_tables: np.ndarray
    ) -> torch.Tensor:
        """The final hidden states [rows, hidden] (after the final norm) of `tokens` at `positions`, their
        keys and values stored at cache `slots`; `block_tables`: int32 [rows, blocks], each its request's."""
        ...
