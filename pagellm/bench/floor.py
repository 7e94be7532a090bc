"""The floor of a benchmark run: the least time this machine could take for the work the run must do.

    floor = max(FLOPs / bf16 matmul peak, bytes / DRAM read bandwidth)

both measured on the spot (this machine's speed drifts; a number from another day means nothing).

FLOPs: 2 * (weights in the decoder's linear layers) per token processed, plus attention's
2 * heads * (head_size + v_head_size) * context per token and layer (q.k and p.v), plus the lm_head
(2 * hidden * vocab) only for positions that sample, plus, in a mixture of experts, 2 * K * (one expert's
weights) per token and MoE layer. Prompt tokens served from the prefix cache cost no FLOPs.

Bytes: the weights (decoder linears and lm_head) once per engine step, plus the routed experts a step's
tokens choose, each once (the expected number of distinct ones under uniform routing, E * (1 - (1 - K/E)^n)
per layer for n tokens: pagellm.bench.experts), plus the KV cache each decode token reads (its cached
context * layers * 2 * kv_heads * head_size * cache element size, one latent row for MLA; the new token's
own K/V is fresh), plus the tokens before a prompt chunk (a cached prefix, earlier chunks), read once.
Sparse attention (DeepSeek-V3.2's indexer): a query attends to at most index_topk latent rows a layer, and
its indexer reads every earlier key (2 * index heads * index head size FLOPs a key, one key row a token).
Embedding rows, activations and norms are left out: a floor may only be low.

Steps: the in-process benches count the steps the engine ran and what each scheduled
(pagellm.bench.steps); `min_steps` and `min_steps_for_intervals` estimate them where only the requests
are known.
"""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from pagellm.bench.experts import Experts, element_size, experts_of_model, mlp_from_hf_config

GiB = 1 << 30

# the machine measurements: big enough to leave the caches, short enough to run before every benchmark
GEMM_SIZE = 2048
STREAM_BYTES = 1 * GiB
BUDGET_S = 0.3


# -- the model's shapes ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelShape:
    """What the floor needs of a model: the weights of its linears, its routed experts and the shapes of
    its attention."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    linear_params: int  # weights of the decoder's linear layers (in * out summed), lm_head excluded
    lm_head_params: int  # hidden * vocab
    linear_bytes: int  # bytes of the decoder linears' parameters (as stored: quantized ones are smaller)
    lm_head_bytes: int
    kv_bytes_per_token: float  # one token's K and V over all layers, as the cache stores them
    layer_windows: tuple[int | None, ...] = ()  # per layer: sliding window or None; () = no layer has one
    v_head_size: int | None = None  # V's head size where it differs (MLA: the latent); None: head_size
    experts: Experts | None = None  # the routed experts, apart from linear_*; None: a dense model
    # a hybrid model's recurrent layers: one sequence's state over all of them (read and written once per
    # step the sequence runs in), and their FLOPs per token (the delta rule's)
    state_bytes: int = 0
    recurrent_flops_per_token: float = 0.0
    # sparse attention (DeepSeek-V3.2's indexer): each query's indexer scores every earlier key (these FLOPs
    # per query and key of context, and these bytes of keys per cached token, over the indexed layers), and
    # its attention reads only index_topk latent rows (`layer_windows` counts them as windows of that size)
    index_flops_per_key: float = 0.0
    index_bytes_per_token: float = 0.0

    @property
    def weight_bytes(self) -> int:
        """Bytes a step that samples reads whole: every linear's weights and the lm_head's (the experts
        are charged by the tokens that choose them: `expert_bytes`)."""
        return self.linear_bytes + self.lm_head_bytes

    def attention_flops(self, attended: int) -> float:
        """q.k and p.v for `attended` (query, token, layer) triples."""
        return 2.0 * self.num_heads * (self.head_size + (self.v_head_size or self.head_size)) * attended

    def expert_flops(self, num_tokens: int) -> float:
        return self.experts.flops_per_token() * num_tokens if self.experts else 0.0

    def expert_bytes(self, num_tokens: int) -> float:
        """Expert bytes one step of `num_tokens` tokens reads (expected, uniform routing)."""
        return self.experts.step_bytes(num_tokens) if self.experts else 0.0

    def attended(self, context: int) -> int:
        """Tokens attended, summed over layers, by one query with `context` tokens of context."""
        if not self.layer_windows:
            return self.num_layers * context
        return sum(context if w is None else min(context, w) for w in self.layer_windows)

    def attended_range(self, first: int, last: int) -> int:
        """sum of attended(c) for c in first..last (inclusive), in closed form; 0 if empty."""
        if last < first:
            return 0
        if not self.layer_windows:
            return self.num_layers * (first + last) * (last - first + 1) // 2
        total = 0
        for w in self.layer_windows:
            if w is None or w >= last:
                total += (first + last) * (last - first + 1) // 2
            elif w < first:
                total += w * (last - first + 1)
            else:  # first..w grow, then w+1..last are capped at w
                total += (first + w) * (w - first + 1) // 2 + w * (last - w)
        return total

    def cached_tokens_read(self, start: int) -> int:
        """(token, layer) pairs of KV cache that queries at positions start.. read: the `start` tokens
        before them, within each layer's window (a query at `start` attends to at most window - 1 of them)."""
        if not self.layer_windows:
            return self.num_layers * start
        return sum(start if w is None else min(start, w - 1) for w in self.layer_windows)

    def kv_read_bytes(self, pairs: int) -> float:
        """Bytes of KV cache read for `pairs` (token, layer) pairs."""
        return self.kv_bytes_per_token / self.num_layers * pairs

    def chunk_work(self, start: int, num_tokens: int, samples: bool) -> Work:
        """One request's share of a step, without the weights: tokens start..start+num_tokens-1 (position p
        attends to p + 1 tokens), the lm_head if it samples, and the KV cache it reads: the tokens before
        the chunk, once (a decode token's context; a prompt chunk's cached prefix or earlier chunks; the
        chunk's own keys and values are fresh)."""
        attended = self.attended_range(start + 1, start + num_tokens)
        keys = (2 * start + num_tokens + 1) * num_tokens // 2  # the indexer's: every earlier key, each query
        return Work(
            linear_flops=2.0 * self.linear_params * num_tokens,
            attention_flops=self.attention_flops(attended)
            + self.recurrent_flops_per_token * num_tokens
            + self.index_flops_per_key * keys,
            lm_head_flops=2.0 * self.lm_head_params if samples else 0.0,
            expert_flops=self.expert_flops(num_tokens),
            kv_bytes=self.kv_read_bytes(self.cached_tokens_read(start)) + self.index_bytes_per_token * start,
            state_bytes=2.0 * self.state_bytes if start > 0 else float(self.state_bytes),
        )

    @classmethod
    def from_hf_config(
        cls, hf_config: Any, dtype: torch.dtype, kv_cache_dtype: torch.dtype | None = None
    ) -> ModelShape:
        """From a Hugging Face config alone (Llama family incl. Qwen2/3 and Mistral, GPT-2, OPT, and the
        mixtures of experts `pagellm.bench.experts` knows, DeepSeek's latent attention included), with
        weights of `dtype`. Raises ValueError for an architecture it does not know."""
        c = hf_config
        kind = getattr(c, "model_type", "")
        if kind in ("gemma4_text", "gemma3n_text") or getattr(c, "is_heterogeneous", False):
            # shapes per layer (transformers' per_layer_config refuses the global reads below), shared KV,
            # per-layer inputs, AltUp: none of which this estimate has
            raise ValueError(f"no floor model for architecture {kind!r} (layers of several shapes)")
        elem = element_size(dtype)
        kv_elem = element_size(kv_cache_dtype or dtype)
        v_head_size, experts = None, None
        if kind in ("gpt2",):
            hidden, layers, heads = c.n_embd, c.n_layer, c.n_head
            inner = getattr(c, "n_inner", None) or 4 * hidden
            linear = layers * (4 * hidden * hidden + 2 * hidden * inner)
            linear_bytes = linear * elem
            kv_heads, head_size = heads, hidden // heads
        elif kind in ("opt",):
            hidden, layers, heads = c.hidden_size, c.num_hidden_layers, c.num_attention_heads
            linear = layers * (4 * hidden * hidden + 2 * hidden * c.ffn_dim)
            linear_bytes = linear * elem
            kv_heads, head_size = heads, hidden // heads
        elif "linear_attention" in hybrid_layer_types(c):
            return cls._hybrid(c, dtype, kv_cache_dtype)
        elif hasattr(c, "intermediate_size") and hasattr(c, "num_attention_heads"):
            hidden, layers, heads = c.hidden_size, c.num_hidden_layers, c.num_attention_heads
            if getattr(c, "kv_lora_rank", None):
                attention, kv_heads, head_size, v_head_size = _mla_attention(c)
            else:
                kv_heads = getattr(c, "num_key_value_heads", None) or heads
                head_size = getattr(c, "head_dim", None) or hidden // heads
                q, kv = heads * head_size, kv_heads * head_size
                attention = hidden * (q + 2 * kv) + q * hidden
            mlp, mlp_bytes, experts = mlp_from_hf_config(c, dtype)
            linear = layers * attention + mlp
            linear_bytes = layers * attention * elem + mlp_bytes
        else:
            raise ValueError(f"no floor model for architecture {kind!r}")
        lm_head = hidden * c.vocab_size
        windows = tuple(_layer_window(c, i) for i in range(layers))
        kv_rows = 1 if v_head_size is not None else 2  # MLA caches one latent row per token and layer
        sparse = _sparse_attention(c, layers, elem)
        if sparse:
            windows = (c.index_topk,) * layers
            linear += sparse["index_params"]
            linear_bytes += sparse["index_params"] * elem
        return cls(
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_size=head_size,
            linear_params=linear,
            lm_head_params=lm_head,
            linear_bytes=linear_bytes,
            lm_head_bytes=lm_head * elem,
            kv_bytes_per_token=layers * kv_rows * kv_heads * head_size * kv_elem,
            layer_windows=windows if any(w is not None for w in windows) else (),
            v_head_size=v_head_size,
            experts=experts,
            index_flops_per_key=sparse.get("flops_per_key", 0.0),
            index_bytes_per_token=sparse.get("bytes_per_token", 0.0),
        )

    @classmethod
    def _hybrid(cls, c: Any, dtype: torch.dtype, kv_cache_dtype: torch.dtype | None) -> ModelShape:
        """Qwen3-Next / Qwen3.5: gated attention layers (q_proj twice as wide, for the gate) and Gated
        DeltaNet layers, whose state is one sequence's conv window and delta-rule state (float32)."""
        elem, kv_elem = element_size(dtype), element_size(kv_cache_dtype or dtype)
        hidden, heads, kv_heads = c.hidden_size, c.num_attention_heads, c.num_key_value_heads
        head_size = getattr(c, "head_dim", None) or hidden // heads
        types = hybrid_layer_types(c)
        full = types.count("full_attention")
        delta = len(types) - full
        q, kv = heads * head_size, kv_heads * head_size
        attention = hidden * (2 * q + 2 * kv) + q * hidden
        v_heads, dk, dv = c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
        key_dim, value_dim = c.linear_num_key_heads * dk, v_heads * dv
        conv_dim = 2 * key_dim + value_dim
        recurrent = hidden * (conv_dim + value_dim) + hidden * 2 * v_heads + value_dim * hidden
        mlp, mlp_bytes, experts = mlp_from_hf_config(c, dtype)
        linear = full * attention + delta * recurrent + mlp
        lm_head = hidden * c.vocab_size
        state = delta * (conv_dim * (c.linear_conv_kernel_dim - 1) * elem + v_heads * dk * dv * 4)
        return cls(
            num_layers=full,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_size=head_size,
            linear_params=linear,
            lm_head_params=lm_head,
            linear_bytes=(full * attention + delta * recurrent) * elem + mlp_bytes,
            lm_head_bytes=lm_head * elem,
            kv_bytes_per_token=full * 2 * kv_heads * head_size * kv_elem,
            experts=experts,
            state_bytes=state,
            recurrent_flops_per_token=delta * DELTA_RULE_FLOPS * v_heads * dk * dv,
        )

    @classmethod
    def from_llm(cls, llm: Any) -> ModelShape:
        """From a loaded engine: its Linear (routers and shared experts among them), latent
        up-projection, FusedMoE and Attention modules, the bytes its weights really take (quantized ones
        included) and its KV cache's bytes per token."""
        from pagellm.models.deepseek import LatentUpProjection
        from pagellm.models.layers.attention import Attention
        from pagellm.models.layers.linear import Linear
        from pagellm.models.layers.sparse_attention import Indexer
        from pagellm.worker.kv_cache import layers_block_bytes

        runner = llm.engine.runner
        model = runner.model
        lm_head = getattr(model, "lm_head", None)
        per_image = set()  # a multimodal model's vision tower and projector: their work is per image
        if getattr(model, "supports_images", False):
            per_image = {id(m) for part in model.image_encoder_modules() for m in part.modules()}
        linears = [
            m
            for m in model.modules()
            if isinstance(m, Linear) and m is not lm_head and id(m) not in per_image
        ]
        latents = [m for m in model.modules() if isinstance(m, LatentUpProjection)]
        indexers = [m for m in model.modules() if isinstance(m, Indexer)]
        index_caches = {id(m.cache) for m in indexers}
        attentions = [m for m in model.modules() if isinstance(m, Attention) and id(m) not in index_caches]
        if not attentions:
            raise ValueError("the model has no Attention layers")
        spec = attentions[0].spec
        linear_bytes = sum(
            t.numel() * t.element_size()
            for m in [*linears, *latents]
            for t in [*m.parameters(), *m.buffers()]
        )
        hf_config = llm.engine.setup.hf_config
        weight = getattr(lm_head, "weight", None)
        packed = getattr(model, "packed_lm_head", None)
        if weight is None and packed is not None:  # the bytes the packed copy really reads (GGUF blocks)
            lm_head_params = hf_config.hidden_size * hf_config.vocab_size
            lm_head_bytes = packed.weight.numel() * packed.weight.element_size()
        elif weight is not None:
            lm_head_params, lm_head_bytes = weight.numel(), weight.numel() * weight.element_size()
        else:
            lm_head_params = hf_config.hidden_size * hf_config.vocab_size
            lm_head_bytes = lm_head_params * element_size(llm.engine.setup.dtype)
        windows = tuple(a.spec.index_topk or a.spec.sliding_window for a in attentions)
        index_bytes = sum(m.cache.spec.head_size * m.cache.spec.cache_dtype.itemsize for m in indexers)
        # a hybrid layout (sliding and full layers) shares each KV tensor between layers of different
        # groups, but every layer still reads its own rows: count the cache by layer, not by tensor
        # (of each layer's own shape; one reading another layer's cache reads that layer's rows)
        by_layer, by_tensor = (
            layers_block_bytes(runner.setup, runner.parallel.tp, runner.block_size, runner.layers, layout)
            for layout in (None, runner.kv_layout)
        )
        return cls(
            num_layers=len(attentions),
            num_heads=spec.num_heads,
            num_kv_heads=spec.num_kv_heads,
            head_size=spec.head_size,
            linear_params=sum(m.in_features * m.out_features for m in linears)
            + sum(m.num_heads * (m.nope + m.v_dim) * m.rank for m in latents),  # packed: no .weight
            lm_head_params=lm_head_params,
            linear_bytes=linear_bytes,
            lm_head_bytes=lm_head_bytes,
            kv_bytes_per_token=(runner.block_bytes() - by_tensor + by_layer) / runner.block_size
            - index_bytes,
            layer_windows=windows if any(w is not None for w in windows) else (),
            v_head_size=spec.v_head_size,
            experts=experts_of_model(model),
            state_bytes=sum(layer.state_spec().bytes for layer in runner.state_layers),
            recurrent_flops_per_token=sum(layer.recurrent_flops_per_token() for layer in runner.state_layers),
            index_flops_per_key=sum(2.0 * m.n_heads * m.head_dim for m in indexers),
            index_bytes_per_token=index_bytes,
        )


DELTA_RULE_FLOPS = 7
"""FLOPs per token, value head and state element of the gated delta rule: the decay (1), k^T S (2), the
rank-one update (2) and q^T S (2)."""


def hybrid_layer_types(c: Any) -> list[str]:
    """A Qwen3-Next / Qwen3.5 config's layer kinds (`layer_types`, else one full-attention layer in every
    `full_attention_interval`); [] for other configs."""
    types = getattr(c, "layer_types", None)
    if types:
        return list(types)
    interval = getattr(c, "full_attention_interval", None)
    if not interval:
        return []
    return [
        "full_attention" if (i + 1) % interval == 0 else "linear_attention"
        for i in range(c.num_hidden_layers)
    ]


def _mla_attention(c: Any) -> tuple[int, int, int, int]:
    """(linear params per layer, KV heads, head size, V head size) of DeepSeek's latent attention as
    pagellm.models.deepseek runs it: MQA over one cached [c_kv, k_pe] row per token, V its c_kv, and
    kv_b_proj (absorbed into the queries and expanded from the outputs) as linear as the projections."""
    hidden, heads, rank = c.hidden_size, c.num_attention_heads, c.kv_lora_rank
    nope, rope, v = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
    q = heads * (nope + rope)
    q_in = c.q_lora_rank or q
    params = (
        hidden * (q_in + rank + rope)
        + (c.q_lora_rank or 0) * q
        + heads * (nope + v) * rank
        + heads * v * hidden
    )
    return params, 1, rank + rope, rank


def _sparse_attention(c: Any, layers: int, elem: int) -> dict[str, float]:
    """DeepSeek-V3.2's (and GLM-5's) lightning indexers: their projections' params, FLOPs per query and
    key and key bytes per token over the layers that have one; {} for a model without."""
    if not getattr(c, "index_topk", None):
        return {}
    kinds = getattr(c, "indexer_types", None) or ["full"] * layers
    n = sum(kind == "full" for kind in kinds)
    heads, dim = c.index_n_heads, c.index_head_dim
    return {
        "index_params": n
        * (c.q_lora_rank * heads * dim + c.hidden_size * dim),  # wq_b, wk (weights_proj: float32, left out)
        "flops_per_key": 2.0 * n * heads * dim,
        "bytes_per_token": float(n * dim * elem),
    }


def _layer_window(hf_config: Any, layer: int) -> int | None:
    if not getattr(hf_config, "use_sliding_window", True):
        return None
    types = getattr(hf_config, "layer_types", None)
    if types is not None and types[layer] != "sliding_attention":
        return None
    return getattr(hf_config, "sliding_window", None) or None


# -- the work of a run ----------------------------------------------------------------------------------


@dataclass
class Work:
    """FLOPs and bytes a run must spend; add runs with `+`."""

    linear_flops: float = 0.0
    attention_flops: float = 0.0
    lm_head_flops: float = 0.0
    expert_flops: float = 0.0
    weight_bytes: float = 0.0
    expert_bytes: float = 0.0
    kv_bytes: float = 0.0
    state_bytes: float = 0.0  # recurrent state read and written (a fresh sequence's is only written)
    steps: int = 0

    @property
    def flops(self) -> float:
        return self.linear_flops + self.attention_flops + self.lm_head_flops + self.expert_flops

    @property
    def bytes(self) -> float:
        return self.weight_bytes + self.expert_bytes + self.kv_bytes + self.state_bytes

    def __add__(self, other: Work) -> Work:
        return Work(**{k: v + getattr(other, k) for k, v in asdict(self).items()})


def request_work(shape: ModelShape, prompt_len: int, output_len: int, cached: int = 0) -> Work:
    """One request without the weights: its prompt in one chunk after `cached` prefix tokens (sampling
    the first output token), then output_len - 1 decode tokens; the one for output token k (2..output_len)
    sits at position prompt_len + k - 2 and attends to prompt_len + k - 1 tokens."""
    work = shape.chunk_work(cached, prompt_len - cached, samples=output_len > 0)
    for k in range(2, output_len + 1) if shape.layer_windows else ():
        work = work + shape.chunk_work(prompt_len + k - 2, 1, samples=True)
    if output_len > 1 and not shape.layer_windows:  # the same in closed form
        n = output_len - 1
        first, last = prompt_len, prompt_len + output_len - 2  # decode positions
        work = work + Work(
            linear_flops=2.0 * shape.linear_params * n,
            attention_flops=shape.attention_flops(shape.attended_range(first + 1, last + 1))
            + shape.recurrent_flops_per_token * n,
            lm_head_flops=2.0 * shape.lm_head_params * n,
            expert_flops=shape.expert_flops(n),
            kv_bytes=shape.kv_read_bytes(shape.attended_range(first, last)),
            state_bytes=2.0 * shape.state_bytes * n,
        )
    return work


def workload_work(
    shape: ModelShape,
    prompt_lens: Sequence[int],
    output_lens: Sequence[int],
    steps: int,
    cached: Sequence[int] | None = None,
) -> Work:
    """Every request's work (prompts unchunked), plus all weights read once per engine step (`steps`).

    The steps' routed experts are those of the schedule `min_steps` counts, all requests at once: one step
    runs every prompt, then step j the j-th output token of each request that has one. It packs the
    tokens densest, so it reads about the fewest experts the requests allow (a step split in two reads at
    least as many: the expected distinct experts are subadditive in the tokens)."""
    cached = cached or [0] * len(prompt_lens)
    total = Work(weight_bytes=float(shape.weight_bytes) * steps, steps=steps)
    for prompt_len, output_len, hit in zip(prompt_lens, output_lens, cached, strict=True):
        total = total + request_work(shape, prompt_len, output_len, hit)
    if shape.experts is not None:
        step_tokens = [sum(p - h for p, h in zip(prompt_lens, cached, strict=True))]
        step_tokens += [sum(1 for n in output_lens if n >= j) for j in range(2, min_steps(output_lens) + 1)]
        total.expert_bytes = sum(shape.expert_bytes(n) for n in step_tokens)
    return total


def step_work(shape: ModelShape, chunks: Sequence[tuple[int, int, bool]]) -> Work:
    """One engine step as scheduled: (start, num_tokens, samples) per request; the decoder's weights are
    read once, the lm_head's if any request samples."""
    total = Work(
        weight_bytes=float(shape.linear_bytes + (shape.lm_head_bytes if any(c[2] for c in chunks) else 0)),
        expert_bytes=shape.expert_bytes(sum(c[1] for c in chunks)),
        steps=1,
    )
    for start, num_tokens, samples in chunks:
        total = total + shape.chunk_work(start, num_tokens, samples)
    return total


def min_steps(output_lens: Sequence[int]) -> int:
    """The fewest engine steps that can produce these outputs when every request runs at once: each step
    gives a request at most one token."""
    return max(output_lens, default=0)


def min_steps_for_intervals(intervals: Sequence[tuple[float, float, int]]) -> int:
    """The fewest engine steps consistent with observed requests (start, end, tokens): a request makes one
    token per step, inside its [start, end]; requests whose intervals do not overlap cannot share a step.
    So the steps are at least the largest total of tokens over requests with pairwise disjoint intervals
    (weighted interval scheduling)."""
    items = sorted(intervals, key=lambda x: x[1])
    ends = [end for _, end, _ in items]
    best = [0] * (len(items) + 1)
    for i, (start, _, tokens) in enumerate(items):
        j = bisect.bisect_left(ends, start, 0, i)  # items[:j] end before this one starts
        best[i + 1] = max(best[i], best[j] + tokens)
    return best[-1]


# -- the machine ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Machine:
    """This machine's bf16 (or run dtype) matmul peak and DRAM read bandwidth."""

    peak_flops: float  # FLOP/s
    read_bytes_s: float  # bytes/s
    dtype: str
    device: str
    threads: int
    measured: bool = True

    def as_dict(self) -> dict[str, Any]:
        return {
            "peak_tflops": self.peak_flops / 1e12,
            "read_gb_s": self.read_bytes_s / 1e9,
            "dtype": self.dtype,
            "device": self.device,
            "threads": self.threads,
            "measured": self.measured,
        }


_MEASURED: dict[tuple[str, str, int], Machine] = {}


def measure_machine(
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    peak_tflops: float | None = None,
    read_gb_s: float | None = None,
) -> Machine:
    """Measure (once per process, dtype, device and thread count) the matmul peak on large square GEMMs
    in `dtype` (on CPU, for half precisions, or float32's where faster) and the read bandwidth (a sum over a 1 GiB tensor). Given values are used instead."""
    device = torch.device(device)
    threads = torch.get_num_threads()
    name = str(dtype).removeprefix("torch.")
    key = (name, str(device), threads)
    if peak_tflops is None or read_gb_s is None:
        if key not in _MEASURED:
            peak = measure_matmul_peak(dtype, device)
            if device.type == "cpu" and dtype in (torch.bfloat16, torch.float16):
                # a half-precision model may multiply in float32 where that is faster (CPUs without native
                # half-precision dot products: pagellm's panel kernel does), so the floor takes the faster
                peak = max(peak, measure_matmul_peak(torch.float32, device))
            _MEASURED[key] = Machine(peak, measure_read_bandwidth(device), name, str(device), threads)
        measured = _MEASURED[key]
    peak = peak_tflops * 1e12 if peak_tflops is not None else measured.peak_flops
    bandwidth = read_gb_s * 1e9 if read_gb_s is not None else measured.read_bytes_s
    given = peak_tflops is not None and read_gb_s is not None
    return Machine(peak, bandwidth, name, str(device), threads, measured=not given)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best_time(fn, device: torch.device, budget_s: float, min_reps: int = 3) -> float:
    fn()  # warm-up
    _sync(device)
    best, start, reps = math.inf, time.perf_counter(), 0
    while reps < min_reps or (time.perf_counter() - start < budget_s and reps < 100):
        t = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - t)
        reps += 1
    return best


@torch.inference_mode()
def measure_matmul_peak(
    dtype: torch.dtype, device: str | torch.device = "cpu", n: int | None = None, budget_s: float = BUDGET_S
) -> float:
    """FLOP/s of the best [n x n] @ [n x n] matmul in `dtype` (n = GEMM_SIZE)."""
    device, n = torch.device(device), n or GEMM_SIZE
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    return 2.0 * n**3 / _best_time(lambda: torch.matmul(a, b, out=out), device, budget_s)


@torch.inference_mode()
def measure_read_bandwidth(
    device: str | torch.device = "cpu", nbytes: int | None = None, budget_s: float = BUDGET_S
) -> float:
    """Bytes/s of the best sum over a float32 tensor of `nbytes` (STREAM_BYTES)."""
    device, nbytes = torch.device(device), nbytes or STREAM_BYTES
    x = torch.ones(nbytes // 4, device=device, dtype=torch.float32)
    return x.numel() * 4 / _best_time(lambda: x.sum(), device, budget_s)


# -- the floor ------------------------------------------------------------------------------------------


@dataclass
class Floor:
    work: Work
    machine: Machine
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def compute_s(self) -> float:
        return self.work.flops / self.machine.peak_flops

    @property
    def memory_s(self) -> float:
        return self.work.bytes / self.machine.read_bytes_s

    @property
    def floor_s(self) -> float:
        return max(self.compute_s, self.memory_s)

    @property
    def bound(self) -> str:
        return "compute" if self.compute_s >= self.memory_s else "memory"

    def report(self, measured_s: float | None = None, output_tokens: int | None = None) -> dict[str, Any]:
        """The floor, its two terms and inputs; with the run's time and output tokens, the floor in
        output tok/s and the run's fraction of the floor (floor / measured: 1.0 = at the floor)."""
        w = self.work
        out: dict[str, Any] = {
            "flops": w.flops,
            "linear_flops": w.linear_flops,
            "attention_flops": w.attention_flops,
            "lm_head_flops": w.lm_head_flops,
            "expert_flops": w.expert_flops,
            "bytes": w.bytes,
            "weight_bytes": w.weight_bytes,
            "expert_bytes": w.expert_bytes,
            "kv_bytes": w.kv_bytes,
            "state_bytes": w.state_bytes,
            "steps": w.steps,
            **self.machine.as_dict(),
            "compute_s": self.compute_s,
            "memory_s": self.memory_s,
            "floor_s": self.floor_s,
            "bound": self.bound,
            **self.extra,
        }
        if output_tokens is not None and self.floor_s > 0:
            out["floor_output_tok_s"] = output_tokens / self.floor_s
        if measured_s is not None and measured_s > 0:
            out["measured_s"] = measured_s
            out["fraction_of_floor"] = self.floor_s / measured_s
        return out


def format_floor(report: dict[str, Any], label: str = "floor") -> str:
    """One line: both terms, the floor in seconds (and output tok/s), and the run's fraction of it."""
    unit = _time_unit(report["floor_s"])
    steps = report["steps"]
    per_step = report["weight_bytes"] / steps / 1e9 if steps else 0.0
    experts = report["expert_bytes"]
    expert_term = (
        f" + experts {experts / 1e9:.3g} GB (each step's expected picks, uniform routing)" if experts else ""
    )
    state = report.get("state_bytes", 0.0)
    state_term = f" + recurrent state {state / 1e9:.3g} GB (read and written)" if state else ""
    line = (
        f"{label}: compute {report['flops'] / 1e12:.3g} TFLOP / {report['peak_tflops']:.2f} TFLOP/s = "
        f"{unit(report['compute_s'])}, memory {report['bytes'] / 1e9:.3g} GB (weights {per_step:.3g} GB x "
        f"{steps} steps{expert_term} + KV {report['kv_bytes'] / 1e9:.3g} GB{state_term}) / "
        f"{report['read_gb_s']:.1f} GB/s = "
        f"{unit(report['memory_s'])} -> floor {unit(report['floor_s'])} ({report['bound']}-bound)"
    )
    if "floor_output_tok_s" in report:
        line += f", {report['floor_output_tok_s']:.0f} output tok/s"
    if "fraction_of_floor" in report:
        line += f"; this run {unit(report['measured_s'])}: {report['fraction_of_floor']:.0%} of the floor"
    return line


def _time_unit(reference: float):
    if reference < 1.0:
        return lambda s: f"{s * 1000:.2f} ms"
    return lambda s: f"{s:.2f} s"
