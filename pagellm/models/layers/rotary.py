"""Rotary position embedding (neox style: the two halves of each head's rotated part rotate together).

Frequencies come from transformers' own rope functions for the config's `rope_parameters`, so every rope
type (default, linear, llama3, yarn with its attention factor, dynamic, longrope, ...) matches the
reference exactly. cos/sin are computed once per step from the positions rather than cached, which costs
little and has no length limit. With `partial_rotary_factor` (Phi-4-mini) only the first `rotary_dim`
features of each head rotate; the rest pass through.

Length-dependent types. transformers picks `dynamic` (NTK) and `longrope` frequencies in each forward call
from the batch's longest position: dynamic rescales its base to the sequence length once it grows past
`max_position_embeddings`; longrope takes its long factors once the sequence is longer than
`original_max_position_embeddings`, its short ones up to it. The engine rotates each token for a length
per token (`ForwardContext.rope_lengths`, sent by the runner; position + 1 in a forward without them, such
as a CUDA-graph decode step, which is the same for every generated token):

    length = max(base, position + 1), base = the request's prompt tokens (dynamic) or its tokens (longrope)

- dynamic: transformers' generate keeps its KV cache, so the prompt's keys stay rotated for the prompt's
  length and each new token's for the length it makes; base = prompt tokens reproduces exactly that.
- longrope: transformers' generate (Phi3ForCausalLM.prepare_inputs_for_generation) drops its cache when a
  sequence first grows past `original_max_position_embeddings` and recomputes it all with the long
  factors, rather than mix short keys with long queries. The engine does the same: the scheduler
  recomputes a request's KV when it grows past the threshold (`Request.rope_outgrown`), and base = its
  tokens rotates every token of the request with the factors of its current length.

So a request's tokens equal transformers generating it alone, whether its prompt is short, long or crosses
the threshold while generating, however the engine splits, preempts or recomputes it. The prompt's keys
depend on that base, so `prefix_cache_salt` keys the prefix cache by it (short and long never share a
block; dynamic prompts longer than `max_position_embeddings` share only with prompts of the same length).
Where the engine cannot match transformers: several prompts batched in one transformers call (it rotates
them all for the longest); transformers' dynamic state kept across generate calls (its frequencies only
grow until a short sequence resets them, so a long prompt after a longer one reuses the longer one's);
speculative drafts past the threshold (verified before the recompute). vLLM instead fixes the choice for
the engine's life: longrope's long factors for every token whenever max_model_len exceeds
`original_max_position_embeddings`, dynamic scaled for the model's whole extended length; that differs from
transformers for every shorter prompt.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from pagellm.core.errors import ConfigError
from pagellm.models.base import head_size
from pagellm.models.context import rope_lengths

BY_LENGTH = ("dynamic", "longrope")
"""Rope types whose frequencies depend on the sequence length."""


def rope_parameters(hf_config: Any) -> dict:
    return getattr(hf_config, "rope_parameters", None) or {}


def rotary_dim(hf_config: Any) -> int:
    """Features of each head that rotate: head_dim x `partial_rotary_factor` (rope parameters or config)."""
    factor = rope_parameters(hf_config).get("partial_rotary_factor")
    if factor is None:
        factor = getattr(hf_config, "partial_rotary_factor", None) or 1.0
    return int(head_size(hf_config) * factor)


class RotaryEmbedding(nn.Module):
    def __init__(self, hf_config):
        super().__init__()
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        params = hf_config.rope_parameters
        self.rope_type = params.get("rope_type", "default")
        if self.rope_type not in ("default", *ROPE_INIT_FUNCTIONS):
            supported = ", ".join(["default", *ROPE_INIT_FUNCTIONS])
            raise ConfigError(f"rope type {self.rope_type!r} is not supported; supported: {supported}")
        self.rotary_dim = rotary_dim(hf_config)
        self.threshold = 0  # length-dependent types: longest length of the unscaled (short) frequencies
        self.theta = self.factor = 0.0  # dynamic: base and factor
        if self.rope_type == "default":
            exponents = torch.arange(0, self.rotary_dim, 2, dtype=torch.float32) / self.rotary_dim
            inv_freq, self.scaling = 1.0 / (params["rope_theta"] ** exponents), 1.0
        else:
            inv_freq, self.scaling = ROPE_INIT_FUNCTIONS[self.rope_type](hf_config)
        if self.rope_type == "longrope":
            self.threshold = int(params["original_max_position_embeddings"])
            long, _ = ROPE_INIT_FUNCTIONS["longrope"](hf_config, seq_len=self.threshold + 1)
            inv_freq = torch.stack([inv_freq, long])  # [short, long]
        elif self.rope_type == "dynamic":
            self.threshold = int(hf_config.max_position_embeddings)
            self.theta, self.factor = float(params["rope_theta"]), float(params["factor"])
        self.scaling = float(self.scaling)
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        axes = mrope_axes(params, inv_freq.shape[-1])
        if axes is not None:
            self.register_buffer("mrope_axes", axes, persistent=False)

    @property
    def by_length(self) -> bool:
        """Whether the frequencies depend on each token's sequence length (see the module's docstring)."""
        return self.rope_type in BY_LENGTH

    @property
    def length_base(self) -> str | None:
        """What a token's length counts besides its position: "prompt" (dynamic) or "tokens" (longrope)."""
        return {"dynamic": "prompt", "longrope": "tokens"}.get(self.rope_type)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 cos and sin of [T, rotary_dim // 2], shared by every layer of one step. Compiled, one
        opaque op: inductor would otherwise recompute them inside every layer's rotation (per head too),
        and on a CPU those sines and cosines cost more than the rotation itself. A length-dependent type
        reads the step's per-token lengths inside its op (from the forward context, like attention).
        A multimodal rope takes positions [3, T] (see `mrope_axes`); given [T] (a text-only model of a
        multimodal checkpoint, such as Qwen3.5's) it is the plain rope, all three positions being equal."""
        if positions.dim() == 2:
            if torch.compiler.is_compiling():
                return torch.ops.pagellm.mrope_cos_sin(
                    positions, self.inv_freq, self.mrope_axes, self.scaling
                )
            return _mrope_cos_sin(positions, self.inv_freq, self.mrope_axes, self.scaling)
        if self.by_length:
            args = (positions, self.inv_freq, self.scaling, self.rope_type, self.threshold, self.theta)
            if torch.compiler.is_compiling():
                return torch.ops.pagellm.rope_cos_sin_by_length(*args, self.factor)
            return _cos_sin_by_length(*args, self.factor)
        if torch.compiler.is_compiling():
            return torch.ops.pagellm.rope_cos_sin(positions, self.inv_freq, self.scaling)
        return _cos_sin(positions, self.inv_freq, self.scaling)


def _cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = positions.float()[:, None] * inv_freq[None, :]
    return freqs.cos() * scaling, freqs.sin() * scaling


def mrope_axes(params: dict, num_freqs: int) -> torch.Tensor | None:
    """Qwen-VL's multimodal rope (`mrope_section` in the rope parameters): each token has a temporal, a
    height and a width position, and each rotary frequency takes one of them; the axis (0, 1, 2) of each of
    the `num_freqs` frequencies. None for a plain rope.

    In sections (Qwen2-VL, Qwen2.5-VL): the first mrope_section[0] frequencies take t, the next h, the rest
    w. Interleaved (`mrope_interleaved`, Qwen3-VL): frequency 3i + 1 takes h while i < mrope_section[1],
    3i + 2 takes w while i < mrope_section[2], the others t, so every axis spans low and high frequencies."""
    section = params.get("mrope_section")
    if not section:
        return None
    if sum(section) != num_freqs:
        raise ConfigError(f"mrope_section {section} does not add up to the {num_freqs} rotary frequencies")
    if not params.get("mrope_interleaved"):
        return torch.repeat_interleave(torch.arange(3), torch.tensor(section))
    axes = torch.zeros(num_freqs, dtype=torch.int64)
    for axis in (1, 2):
        axes[axis : 3 * section[axis] : 3] = axis
    return axes


def _mrope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, axes: torch.Tensor, scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each frequency's angle from its axis' position: positions [3, T] -> cos, sin [T, len(inv_freq)],
    contiguous as the op's fake says (a compiled graph reads them by those strides)."""
    freqs = positions.t()[:, axes.to(positions.device)].float() * inv_freq[None, :]
    return freqs.cos() * scaling, freqs.sin() * scaling


@torch.library.custom_op("pagellm::mrope_cos_sin", mutates_args=())
def _mrope_cos_sin_op(
    positions: torch.Tensor, inv_freq: torch.Tensor, axes: torch.Tensor, scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return _mrope_cos_sin(positions, inv_freq, axes, scaling)


@_mrope_cos_sin_op.register_fake
def _(
    positions: torch.Tensor, inv_freq: torch.Tensor, axes: torch.Tensor, scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (positions.shape[1], inv_freq.shape[-1])
    return inv_freq.new_empty(shape), inv_freq.new_empty(shape)


def _cos_sin_by_length(
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    scaling: float,
    rope_type: str,
    threshold: int,
    theta: float,
    factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin with each token's frequencies chosen by its sequence length, as transformers'
    `dynamic_rope_update` chooses them for the whole forward from `max(position_ids) + 1`."""
    lengths = rope_lengths()
    lengths = positions + 1 if lengths is None else lengths.to(positions.device)
    if rope_type == "longrope":  # inv_freq: [short, long]
        inv = torch.where((lengths > threshold)[:, None], inv_freq[1][None, :], inv_freq[0][None, :])
    else:  # dynamic: transformers' `_compute_dynamic_ntk_parameters` for seq_len = length, per token
        dim = 2 * inv_freq.shape[0]
        seq_len = torch.maximum(lengths, torch.tensor(threshold, dtype=lengths.dtype, device=lengths.device))
        # transformers takes this power of a single float32 value; over a vector torch's float32 power is off
        # by an ulp at times, its float64 one rounded is not
        stretch = ((factor * seq_len / threshold) - (factor - 1)).double() ** (dim / (dim - 2))
        base = theta * stretch.float()
        exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=positions.device).float() / dim
        scaled = 1.0 / (base[:, None] ** exponents[None, :])
        inv = torch.where((lengths > threshold)[:, None], scaled, inv_freq[None, :])
    freqs = positions.float()[:, None] * inv
    return freqs.cos() * scaling, freqs.sin() * scaling


@torch.library.custom_op("pagellm::rope_cos_sin", mutates_args=())
def _cos_sin_op(
    positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return _cos_sin(positions, inv_freq, scaling)


@_cos_sin_op.register_fake
def _(positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (positions.shape[0], inv_freq.shape[-1])
    return inv_freq.new_empty(shape), inv_freq.new_empty(shape)


@torch.library.custom_op("pagellm::rope_cos_sin_by_length", mutates_args=())
def _cos_sin_by_length_op(
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    scaling: float,
    rope_type: str,
    threshold: int,
    theta: float,
    factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's per-token lengths are read inside, from the forward context (not an argument)."""
    return _cos_sin_by_length(positions, inv_freq, scaling, rope_type, threshold, theta, factor)


@_cos_sin_by_length_op.register_fake
def _(
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    scaling: float,
    rope_type: str,
    threshold: int,
    theta: float,
    factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (positions.shape[0], inv_freq.shape[-1])
    return inv_freq.new_empty(shape), inv_freq.new_empty(shape)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, head_dim] by cos/sin [T, rotary_dim // 2]: the first rotary_dim features of each
    head (all of them, usually); the others pass through (partial rotary)."""
    cos = cos.to(x.dtype)[:, None, :]
    sin = sin.to(x.dtype)[:, None, :]
    rotated = 2 * cos.shape[-1]
    if rotated == x.shape[-1]:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    x1, x2, rest = x.split([rotated // 2, rotated // 2, x.shape[-1] - rotated], dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest), dim=-1)


def rotate_pairs(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, round_cos_sin: bool = False
) -> torch.Tensor:
    """Rotate x [T, heads, head_dim] by cos/sin [T, head_dim // 2] in interleaved pairs: (x[2i], x[2i+1]) by
    frequency i (GPT-J's layout), in float32 and back in x's dtype. `round_cos_sin`: cos and sin rounded to
    x's dtype first, as some transformers models do before rotating in float32 (in bf16 the two differ)."""
    if round_cos_sin:
        cos, sin = cos.to(x.dtype).float(), sin.to(x.dtype).float()
    c, s = cos[:, None, :], sin[:, None, :]
    pairs = x.float().unflatten(-1, (-1, 2))
    x0, x1 = pairs[..., 0], pairs[..., 1]
    return torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1).flatten(-2).to(x.dtype)


def pairs_to_halves(x: torch.Tensor, rotated: int | None = None) -> torch.Tensor:
    """x [T, heads, head_dim]: the first `rotated` features of each head (all by default) from pairs (x0, x1),
    (x2, x3), ... to halves (x0, x2, ...), (x1, x3, ...); the others stay where they are. Moving q and k alike
    keeps every q.k, so apply_rotary then rotates interleaved pairs."""
    rotated = x.shape[-1] if rotated is None else rotated
    return torch.cat([x[..., 0:rotated:2], x[..., 1:rotated:2], x[..., rotated:]], dim=-1)


def request_length_base(model: nn.Module) -> str | None:
    """What the model's rotary counts in a token's length besides its position (`length_base`): "prompt",
    "tokens", or None when its rope does not depend on the length."""
    return next(
        (m.length_base for m in model.modules() if isinstance(m, RotaryEmbedding) and m.by_length), None
    )


def rope_salt_function(hf_config: Any) -> Callable[[int, int], tuple | None] | None:
    """For a length-dependent rope, (prompt tokens, tokens) -> what a request's KV depends on besides its
    tokens (see the module's docstring); None for any other. A request whose value changes as it grows
    (longrope past `original_max_position_embeddings`) has its KV recomputed."""
    rope_type = rope_parameters(hf_config).get("rope_type")
    if rope_type not in BY_LENGTH:
        return None
    return functools.partial(prefix_cache_salt, hf_config)


def prefix_cache_salt(hf_config: Any, num_prompt_tokens: int, num_tokens: int) -> tuple | None:
    params = rope_parameters(hf_config)
    rope_type = params.get("rope_type")
    if rope_type == "longrope":
        return ("longrope", num_tokens > int(params["original_max_position_embeddings"]))
    if rope_type == "dynamic" and num_prompt_tokens > int(hf_config.max_position_embeddings):
        return ("dynamic", num_prompt_tokens)
    return None


def scaled_max_positions(hf_config: Any, limit: int) -> int:
    """The longest sequence a model with rope scaling takes, as vLLM computes it: `linear` and `dynamic`
    stretch the config's `max_position_embeddings` by their factor, `yarn` reaches its
    `original_max_position_embeddings` x factor; `llama3` and `longrope` configs state their extended
    length as `max_position_embeddings` already."""
    params = rope_parameters(hf_config)
    rope_type, factor = params.get("rope_type"), params.get("factor")
    if not factor or rope_type not in ("linear", "dynamic", "yarn"):
        return limit
    if rope_type == "yarn" and params.get("original_max_position_embeddings"):
        return max(limit, int(params["original_max_position_embeddings"] * factor))
    return int(limit * factor)
