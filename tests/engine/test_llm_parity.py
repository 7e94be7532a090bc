"""Greedy outputs equal transformers' token for token, for every architecture and every engine setting
that changes how the work is split: chunked prefill, preemption, prefix-cache hits, tiny batches. Llama runs
the whole matrix in the default run; every other architecture runs one combined check there
(test_family_parity.py) and this matrix under -m slow."""

from __future__ import annotations

import pytest
import torch
from parity import (
    ARCHS,
    FAMILIES,
    Reference,
    assert_greedy_parity,
    max_logprob_error,
    mixed_prompts,
    tiny_model_and_reference,
)
from tiny import make_tiny_checkpoint

from pagellm import LLM, SamplingParams
from pagellm.core.config import EngineConfig
from pagellm.engine.setup import resolve_engine

MAX_TOKENS = 16


@pytest.fixture(
    scope="module",
    params=["llama", *(pytest.param(a, marks=pytest.mark.slow) for a in [*ARCHS, *FAMILIES] if a != "llama")],
)
def model(request, tmp_path_factory):
    return tiny_model_and_reference(request.param, tmp_path_factory.mktemp(request.param), MAX_TOKENS)


def engine(path, **overrides) -> LLM:
    settings = dict(dtype="float32", num_kv_blocks=400, max_model_len=400)
    settings.update(overrides)
    return LLM(str(path), **settings)


def test_default_settings(model):
    path, reference = model
    assert_greedy_parity(engine(path), reference, mixed_prompts(300))


def test_chunked_prefill_with_a_small_token_budget(model):
    path, reference = model
    llm = engine(path, max_num_batched_tokens=40, max_num_seqs=8)
    assert_greedy_parity(llm, reference, mixed_prompts(300))


def test_preemption_under_a_tiny_kv_cache(model):
    path, reference = model
    # 26 blocks of every KV cache group, one more than a 400-token request takes: the start-up check counts
    # every group at full length, while the groups share one pool and a sliding window's group frees its
    # blocks as the window passes (30 a group left GPT-OSS's 8-token windows room never to preempt)
    groups = resolve_engine(EngineConfig(model=str(path), dtype="float32")).kv_layout.num_groups
    llm = engine(path, num_kv_blocks=26 * groups, max_model_len=400)
    # two sets of prompts at once, ~200 blocks of full attention: more than the pool of six groups holds
    assert_greedy_parity(llm, reference, mixed_prompts(300) + mixed_prompts(300, seed=1))
    assert llm.engine.stats().num_preemptions > 0


def test_shared_prefixes_hit_the_prefix_cache(model):
    path, reference = model
    llm = engine(path)
    if llm.engine.runner.state_layers:
        pytest.skip(
            "prefix caching is off for models with recurrent layers (test_prefix_caching_off runs them)"
        )
    prompts = mixed_prompts(300, seed=1, shared_prefix=40)
    assert_greedy_parity(llm, reference, prompts[:1])  # the first request fills the cache
    assert_greedy_parity(llm, reference, prompts[1:])
    stats = llm.engine.stats()
    assert stats.prefix_cache_hits >= 32 * (len(prompts) - 1)  # two full 16-token blocks of the prefix each


def test_two_sequences_at_a_time(model):
    path, reference = model
    assert_greedy_parity(engine(path, max_num_seqs=2), reference, mixed_prompts(300))


def test_prefix_caching_off(model):
    path, reference = model
    llm = engine(path, enable_prefix_caching=False)
    assert_greedy_parity(llm, reference, mixed_prompts(300, seed=1, shared_prefix=40))
    assert llm.engine.stats().prefix_cache_hits == 0


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Checkpoints and references built once per architecture, on demand."""
    cache = {}

    def get(arch):
        if arch not in cache:
            overrides = {**ARCHS, **FAMILIES}[arch]
            path = make_tiny_checkpoint(arch.split("-")[0], tmp_path_factory.mktemp(arch), **overrides)
            cache[arch] = path, Reference(path, MAX_TOKENS)
        return cache[arch]

    return get


# FLEX_ATTENTION (the slowest here, never the one selected on CPU) under -m slow; tests/attention_backends
# checks it against the reference
@pytest.mark.parametrize(
    "backend", ["TORCH_SDPA", "CPU_ATTN", pytest.param("FLEX_ATTENTION", marks=pytest.mark.slow)]
)
@pytest.mark.parametrize(
    "arch",
    [
        "llama",
        *(
            pytest.param(a, marks=pytest.mark.slow)
            for a in ("mistral-sliding-window", "qwen2", "qwen3", "gpt2", "opt", "llama4_text")
        ),
    ],
)
def test_every_backend_that_runs_here(checkpoints, arch, backend):
    path, reference = checkpoints(arch)
    llm = engine(path, attention_backend=backend, max_num_batched_tokens=64, max_num_seqs=8)
    assert llm.engine.setup.backend.name == backend
    assert_greedy_parity(llm, reference, mixed_prompts(300))


@pytest.mark.parametrize(
    "arch",
    [
        "llama",
        *(
            pytest.param(a, marks=pytest.mark.slow)
            for a in ("mistral-sliding-window", "gpt2", "opt", "llama4_text")  # Llama 4: chunked attention
        ),
    ],
)
def test_compiled_forward(checkpoints, arch):
    """The default outside the test suite (tox sets PAGELLM_ENFORCE_EAGER=1): torch.compile'd forward."""
    path, reference = checkpoints(arch)
    llm = engine(path, enforce_eager=False, max_num_batched_tokens=64, max_num_seqs=8)
    assert llm.engine.runner.forward is not llm.engine.runner.model
    assert_greedy_parity(llm, reference, mixed_prompts(300))


def test_compiled_forward_is_one_graph_for_every_token_count(checkpoints):
    """Dynamo compiles one graph at start-up and no other, a lone request's one-token decodes included (a
    graph of its own for one token took a third of the compile time and bought no speed)."""
    from torch._dynamo.utils import counters

    path, _ = checkpoints("llama")
    torch._dynamo.reset()  # an earlier test's graph of the same model class would be reused, not counted
    before = counters["stats"]["unique_graphs"]
    llm = engine(path, attention_backend="CPU_ATTN", enforce_eager=False)  # named: no timing runs compile
    assert counters["stats"]["unique_graphs"] - before == 1
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for batch in (1, 3):  # one-token decodes, then three-token ones beside prefills
        llm.generate([{"prompt_token_ids": p} for p in mixed_prompts(300)[:batch]], params, use_tqdm=False)
    assert counters["stats"]["unique_graphs"] - before == 1


@pytest.mark.slow
def test_compiled_forward_with_packed_linears(checkpoints):
    """bfloat16 packs the linears (oneDNN on CPU); the compile must keep them rather than fall back to
    eager, which it silently did for a while (inductor cannot lower a packed weight)."""
    path, _ = checkpoints("llama")
    llm = engine(path, dtype="bfloat16", enforce_eager=False, max_num_batched_tokens=64, max_num_seqs=8)
    runner = llm.engine.runner
    assert runner.forward is not runner.model  # compiled, no fallback
    eager = engine(path, dtype="bfloat16", max_num_batched_tokens=64, max_num_seqs=8)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in mixed_prompts(300)[:4]]
    compiled_ids = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    eager_ids = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    # fused norms round differently in bfloat16: most tokens agree; a few may flip at near-ties
    agree = sum(
        a == b for c, e in zip(compiled_ids, eager_ids, strict=True) for a, b in zip(c, e, strict=True)
    )
    assert agree >= 0.75 * sum(len(c) for c in compiled_ids), (compiled_ids, eager_ids)


FP8_LOGPROB_TOLERANCE = {"fp8_e4m3": 0.3, "fp8_e5m2": 0.5}
"""Largest log-probability error a one-byte KV cache may add on the tiny test models (random weights, so
their logits are far more sensitive to K/V rounding than a trained model's); measured 0.24 and 0.40.
The engine's own math is checked exactly: both backends read the same rounded cache and must agree."""


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", pytest.param("fp8_e5m2", marks=pytest.mark.slow)])
def test_fp8_kv_cache_logprobs_stay_close(checkpoints, kv_cache_dtype):
    path, reference = checkpoints("llama")
    prompts = mixed_prompts(300)[::2]
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=0, ignore_eos=True)
    outputs = {}
    for backend in ("CPU_ATTN", "TORCH_SDPA"):
        llm = engine(path, kv_cache_dtype=kv_cache_dtype, attention_backend=backend, max_num_seqs=8)
        assert llm.engine.runner.kv_caches[0].dtype.itemsize == 1
        assert max_logprob_error(llm, reference, prompts, 8) < FP8_LOGPROB_TOLERANCE[kv_cache_dtype]
        outputs[backend] = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for ours, sdpa in zip(outputs["CPU_ATTN"], outputs["TORCH_SDPA"], strict=True):
        assert ours.outputs[0].token_ids == sdpa.outputs[0].token_ids
        for mine, theirs in zip(ours.outputs[0].logprobs, sdpa.outputs[0].logprobs, strict=True):
            # 1e-7 differences in the backends' float32 sums can flip a one-byte rounding of a later
            # layer's K/V, so the two drift apart a little along long sequences (1e-4 measured)
            assert all(abs(mine[t].logprob - theirs[t].logprob) < 1e-3 for t in mine)


INT8_LOGPROB_TOLERANCE = 0.1
"""Largest log-probability error the int8 KV cache may add on the tiny random-weight test model; measured
0.031 (fp8: 0.24 and 0.40)."""


def test_int8_kv_cache_logprobs_stay_close(checkpoints):
    """int8 rows with per-token, per-head scales: only CPU_ATTN reads them, and the auto selector finds it."""
    path, reference = checkpoints("llama")
    llm = engine(path, kv_cache_dtype="int8", max_num_seqs=8)
    assert llm.engine.setup.backend.name == "CPU_ATTN"
    cache = llm.engine.runner.kv_caches[0]
    assert cache.dtype == torch.int8 and cache.shape[-1] == llm.engine.setup.spec.head_size + 4
    error = max_logprob_error(llm, reference, mixed_prompts(300)[::2], 8)
    assert error < INT8_LOGPROB_TOLERANCE, error
