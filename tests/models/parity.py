"""Greedy parity against transformers: the oracle every engine setting is checked with."""

from __future__ import annotations

import random
import warnings
from pathlib import Path

import torch
from session_device import session_device
from sparse_ties import indexer_ties_note

from pagellm import LLM, SamplingParams

TIE = 1e-4  # a divergence is accepted only where both engines rate the two tokens this close
# every architecture the parity tests run, with its config overrides
ARCHS = {
    "llama": {},
    "mistral-sliding-window": {"sliding_window": 48},
    "qwen2": {},
    "qwen3": {},
    "gpt2": {},
    "opt": {},
}
PHI3_LONGROPE = {
    # Phi-3-128k / Phi-4-mini style: LongRoPE, 3/4 of each head rotating, short factors up to 32 tokens, so
    # the parity prompts lie on both sides and some grow past it while generating
    "original_max_position_embeddings": 32,
    "rope_parameters": {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.75,
        "original_max_position_embeddings": 32,
        "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
        "long_factor": [1.0, 1.5, 2.5, 4.0, 8.0, 16.0],
    },
}
GEMMA4_MOE = {
    "enable_moe_block": True,
    "num_experts": 8,
    "top_k_experts": 2,
    "moe_intermediate_size": 32,
    "num_kv_shared_layers": 0,
    "hidden_size_per_layer_input": 0,
}
FAMILIES: dict[str, dict] = {
    # newer families (and their variants, "family-variant"): one combined check each in the default run
    # (tests/engine/test_family_parity.py), the whole settings matrix of test_llm_parity.py under -m slow
    "gemma2": {},
    "gemma3_text": {},
    "phi3": {},
    "phi3-longrope": PHI3_LONGROPE,
    "granite": {},
    "olmo2": {},
    # OLMo 3: windows of 32 on three layers of four, a rope per layer type (YaRN on the full layer)
    "olmo3": {},
    "smollm3": {},
    # Seed-OSS: head_dim apart from hidden / heads, q/k/v biases without one on o_proj
    "seed_oss": {},
    # EXAONE 4: windows of 32 with rotary on three layers of four, the fourth full without rotary (NoPE)
    "exaone4": {},
    # StarCoder2: LayerNorms and biases everywhere, the plain MLP, a window of 32 on every layer, tied head
    "starcoder2": {},
    # Command R7B / A: the parallel block, 3 window layers with interleaved rotary : 1 global without
    # (two KV cache groups), logit_scale, tied head
    "cohere2": {},
    # mixtures of experts (8 experts, 2 per token); Qwen2-MoE's shared expert, and a dense layer between
    "qwen3_moe": {},
    "qwen2_moe-dense-layer": {"num_hidden_layers": 3, "mlp_only_layers": [1]},
    "mixtral": {},
    # GPT-OSS: sinks, windows of 8 on alternate layers, YaRN, 4 experts with biases and the clamped SwiGLU
    "gpt_oss": {},
    # Multi-head Latent Attention, a dense layer then a mixture of experts with shared experts
    # (tests/models/tiny.py): V2-Lite-like (softmax top 2) and V3-like (sigmoid, correction bias, groups)
    "deepseek_v2": {},
    "deepseek_v3": {},
    # DeepSeek-V3.2: V3 with the lightning indexer, each query reading its 8 best earlier tokens (a KV-cache
    # group of indexer keys beside the latent one); ties at the k-th score: tests/models/test_deepseek_v32.py
    "deepseek_v32": {},
    # GLM-5: V3.2's sparse attention, the indexer's rope in pairs, layers 1 and 2 reading layer 0's choice
    "glm_moe_dsa": {},
    # GLM-4 dense: half of each head rotating in interleaved pairs, norms after both blocks, fused gate_up
    "glm4": {},
    # GLM-4.5: partial rotary, q/k norms, q/k/v biases; V3's routing (one group) and a shared expert
    "glm4_moe": {},
    # Llama 4: chunks of 32 on the rope layers (a KV cache group freeing whole chunks), interleaved rotary,
    # L2 q/k norms, a NoPE layer with the attention temperature; sigmoid top-2 routing on the experts' input
    "llama4_text": {},
    # Gemma 4 (tests/models/tiny.py): per-layer head sizes and KV heads, K = V, KV read by the last 3 layers
    # (two KV tensor shapes, three layers without a cache), per-layer inputs; and its MoE form (experts
    # beside the MLP, no shared KV or per-layer inputs: 26B-A4B's shape), under -m slow
    "gemma4_text": {},
    "gemma4_text-moe": GEMMA4_MOE,
    # Gemma 3n: AltUp's 4 streams, LAuReL, activation sparsity, per-layer inputs, KV read by the last 3 layers
    "gemma3n_text": {},
    # OLMoE: q/k norms over the whole projections, 8 experts in every layer (top 2, not renormalised)
    "olmoe": {},
    # Granite MoE: Granite's scalars, stacked experts (softmax over the top 2), tied embeddings
    "granitemoe": {},
    # ERNIE 4.5 MoE: interleaved rotary, dense layers around the sparse ones, correction bias, shared experts
    "ernie4_5_moe": {},
    # MiniMax-M2: q/k norms over the whole projections, partial rotary, sigmoid routing with the correction bias
    "minimax_m2": {},
    # Hunyuan MoE: q/k norms after the rotary, NTK-alpha rope, a shared MLP beside experts, top k per layer
    "hunyuan_v1_moe": {},
    # Ministral 3: YaRN and the queries scaled by position (steps of 32 tokens), head_dim 32
    "ministral3": {},
    # Mistral 4: DeepSeek-V3's latent attention with the queries scaled by position, a dense layer, then
    # experts routed by softmax over groups (no correction bias) and a shared expert
    "mistral4": {},
    # OLMo Hybrid: Gated DeltaNet layers with beta in (0, 2) (a recurrent state per sequence: prefix caching
    # off) beside OLMo attention without rotary
    "olmo_hybrid": {},
    # Kimi Linear: KDA layers (per-channel decay, a recurrent state per sequence) beside MLA without rotary,
    # a dense layer, then V3's routing (sigmoid, correction bias, groups) over 8 experts and a shared expert
    "kimi_linear": {},
    # Qwen3 with windows on its last layers (max_window_layers): two KV cache groups, full and window 32
    "qwen3-mixed-windows": {
        "num_hidden_layers": 4,
        "use_sliding_window": True,
        "sliding_window": 32,
        "max_window_layers": 2,
    },
}


GGUF_FAMILIES: dict[str, dict] = {
    # what pagellm.bench.gguf_convert writes as llama.cpp does, and the fields of each variant that
    # transformers' GGUF reader drops (pagellm/models/gguf_config.py reads them from the file)
    "gemma2": FAMILIES["gemma2"],
    "gemma2-softcaps": {"attn_logit_softcapping": 2.0, "final_logit_softcapping": 5.0},
    # shaped as the 27B models, told apart by their layer count: attention scaled by hidden size / heads
    "gemma2-27b": {"num_hidden_layers": 46, "head_dim": 8, "query_pre_attn_scalar": 16},
    "gemma3_text": FAMILIES["gemma3_text"],
    "gemma3_text-linear-rope": {  # Gemma 3 4B and larger: global positions scaled by 8
        "rope_parameters": {
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        }
    },
    "gemma3_text-27b": {"num_hidden_layers": 62, "head_dim": 8, "query_pre_attn_scalar": 16},
    "phi3": FAMILIES["phi3"],
    "phi3-partial-rotary": {"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.75}},
    "phi3-longrope": PHI3_LONGROPE,  # partial rotary too, as Phi-4-mini
    # mixtures of experts, every layer one (llama.cpp has no dense layers); the expert and shared expert
    # widths and Qwen3-MoE's renormalisation are fields transformers' reader drops
    "qwen3_moe": FAMILIES["qwen3_moe"],
    "qwen2_moe": {},
    "mixtral": {"head_dim": 16},  # llama.cpp states the head size, which Mixtral's config leaves unset
}


SLOW_FAMILIES = {"qwen3_moe", "mixtral", "deepseek_v2", "gemma4_text-moe"}
"""Families whose combined check runs only under -m slow: the mixtures of experts share one layer, so one
of them (Qwen2-MoE, the one with a shared expert and a dense layer) stands for them in the default run;
DeepSeek-V3 stands for V2 (the same latent attention and MoE block; V2's own q path, rope and routing are
checked against transformers' logits in tests/models/test_deepseek.py); Gemma 4's MoE form is checked
against transformers' logits in tests/models/test_gemma4.py."""


def tiny_model_and_reference(arch: str, tmp_path: Path, max_tokens: int) -> tuple[Path, Reference]:
    """A tiny checkpoint of one of ARCHS (e.g. "mistral-sliding-window") and its transformers oracle."""
    from tiny import make_tiny_checkpoint

    path = make_tiny_checkpoint(arch.split("-")[0], tmp_path, **{**ARCHS, **FAMILIES}[arch])
    return path, Reference(path, max_tokens)


def small_kv_cache(path: Path, max_model_len: int, token_budget: int, spare: int = 15) -> int:
    """`num_kv_blocks` for one request of max_model_len and `spare` blocks more, over the model's KV cache
    groups (a block of a windowed model holds fewer layers), so that a test's prompts must preempt."""
    from pagellm.core.config import EngineConfig
    from pagellm.core.kv_cache_spec import blocks_per_request
    from pagellm.engine.setup import resolve_engine

    setup = resolve_engine(EngineConfig(model=str(path), dtype="float32", max_model_len=max_model_len))
    windows = setup.kv_layout.windows
    return blocks_per_request(windows, setup.spec.block_size, max_model_len, token_budget) + spare


def chunked_llm(path: Path, max_model_len: int, token_budget: int, spare: int = 15) -> LLM:
    """A float32 engine of up to 8 sequences that prefills in steps of `token_budget` tokens over a
    `small_kv_cache`, so that long prompts go in chunks and a batch of them preempts."""
    return LLM(
        str(path),
        dtype="float32",
        max_model_len=max_model_len,
        num_kv_blocks=small_kv_cache(path, max_model_len, token_budget, spare),
        max_num_batched_tokens=token_budget,
        max_num_seqs=8,
    )


def assert_two_rank_parity(
    family: str, tmp_path: Path, every: int, max_model_len: int | None = None, **parallel
) -> None:
    """A tiny `family` checkpoint (of FAMILIES) on 2 gloo ranks (`parallel`: tensor_parallel_size=2,
    pipeline_parallel_size=2, ...) in an eager engine of 64-token steps: greedy parity of every `every`-th
    mixed prompt. The KV cache is 40 blocks, or with `max_model_len` one request of it over the model's KV
    cache groups (a windowed model's block holds fewer layers) and spare blocks."""
    path, reference = tiny_model_and_reference(family, tmp_path, 12)
    if max_model_len is not None:
        parallel.update(max_model_len=max_model_len, num_kv_blocks=small_kv_cache(path, max_model_len, 64))
    llm = LLM(
        str(path),
        **{"num_kv_blocks": 40, **parallel},
        dtype="float32",
        enforce_eager=True,
        max_num_batched_tokens=64,
        max_num_seqs=16,
    )
    try:
        assert_greedy_parity(llm, reference, mixed_prompts(300)[::every])
    finally:
        llm.shutdown()


def mixed_prompts(vocab: int, seed: int = 0, shared_prefix: int = 0) -> list[list[int]]:
    """16+ prompts from 1 to 330 tokens, including exact multiples of the block size (16)."""
    rng = random.Random(seed)
    lengths = [1, 2, 7, 15, 16, 17, 31, 32, 33, 48, 64, 100, 128, 200, 256, 330, 5, 80]
    prefix = [rng.randrange(3, vocab) for _ in range(shared_prefix)]
    return [prefix + [rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


class Reference:
    """transformers greedy generate on the same weights, in float32, one prompt at a time (cached), on the
    session's device (`pytest --device`), where the engine under test runs. `gguf_file`: the model is that
    file in `model_dir`, read by transformers' GGUF loader. `auto_class`: the transformers auto class that
    loads the checkpoint as its authors run it (AutoModelForImageTextToText for a multimodal one)."""

    def __init__(
        self,
        model_dir: Path,
        max_tokens: int,
        gguf_file: str | None = None,
        auto_class: str = "AutoModelForCausalLM",
    ):
        import transformers

        model = getattr(transformers, auto_class).from_pretrained(
            model_dir, gguf_file=gguf_file, dtype=torch.float32
        )
        self.model = model.to(session_device()).eval()
        self.max_tokens = max_tokens
        self.cache: dict[tuple[int, ...], list[int]] = {}

    @torch.no_grad()
    def generate(self, prompt: list[int]) -> list[int]:
        key = tuple(prompt)
        if key not in self.cache:
            ids = torch.tensor([prompt], device=self.model.device)
            out = self.model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=self.max_tokens, do_sample=False
            )
            self.cache[key] = out[0, len(prompt) :].tolist()
        return self.cache[key]

    @torch.no_grad()
    def logprobs(self, tokens: list[int]) -> torch.Tensor:
        ids = torch.tensor([tokens], device=self.model.device)
        return self.model(ids).logits[0, -1].float().log_softmax(-1)


def assert_greedy_parity(llm: LLM, reference: Reference, prompts: list[list[int]]) -> None:
    params = SamplingParams(temperature=0, max_tokens=reference.max_tokens, logprobs=2)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, output in zip(prompts, outputs, strict=True):
        ours = output.outputs[0].token_ids
        theirs = reference.generate(prompt)
        if ours == theirs:
            continue
        j = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b), None)
        assert j is not None, (
            f"prompt of {len(prompt)} tokens: lengths differ: ours {ours} vs transformers {theirs}"
        )
        ref_lp = reference.logprobs(prompt + theirs[:j])
        our_lp = output.outputs[0].logprobs[j]
        a, b = ours[j], theirs[j]
        ref_gap = abs(float(ref_lp[a] - ref_lp[b]))
        our_gap = abs(our_lp[a].logprob - our_lp[b].logprob) if b in our_lp else float("inf")
        assert ref_gap < TIE and our_gap < TIE, (
            f"prompt of {len(prompt)} tokens diverges at output {j}: ours {a}, transformers {b} "
            f"(log-prob gaps: transformers {ref_gap:.2e}, ours {our_gap:.2e})\nours {ours}\ntransformers {theirs}"
            f"{indexer_ties_note(reference.model, prompt + theirs)}"  # sparse attention: say where its top-k ties
        )
        warnings.warn(
            f"accepted near-tie divergence at output {j} (gaps {ref_gap:.1e}, {our_gap:.1e})", stacklevel=1
        )


def max_logprob_error(llm: LLM, reference: Reference, prompts: list[list[int]], max_tokens: int) -> float:
    """Largest difference between the log-probability our engine gave each token it chose greedily and
    the one transformers gives that token after the same prefix (teacher-forced along our output)."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=0, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    worst = 0.0
    for prompt, output in zip(prompts, outputs, strict=True):
        ours = output.outputs[0].token_ids
        for j, token in enumerate(ours):
            theirs = float(reference.logprobs(prompt + ours[:j])[token])
            worst = max(worst, abs(output.outputs[0].logprobs[j][token].logprob - theirs))
    return worst
