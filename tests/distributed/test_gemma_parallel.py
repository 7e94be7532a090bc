"""Gemma 2 and Gemma 3 (text) split over 2 gloo ranks on this CPU, by tensor (heads, MLP and vocabulary
sharded; the soft-capped logits gathered) and by pipeline (per-layer-type rope on every stage): greedy
tokens equal transformers' through chunked prefill and preemption, as tests/distributed/test_tensor_parallel.py
checks for the Llama family."""

from __future__ import annotations

import pytest
from parity import assert_greedy_parity, mixed_prompts, small_kv_cache, tiny_model_and_reference

from pagellm import LLM

MAX_TOKENS = 12
SETTINGS = dict(
    dtype="float32", enforce_eager=True, max_model_len=300, max_num_batched_tokens=64, max_num_seqs=16
)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root, built = tmp_path_factory.mktemp("gemma-parallel"), {}

    def get(arch):  # built on first use: the default run needs only Gemma 3's
        if arch not in built:
            built[arch] = tiny_model_and_reference(arch, root, MAX_TOKENS)
        return built[arch]

    return get


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "arch,tp,pp",
    [
        # the default run's tensor parallelism: tests/distributed/test_tensor_parallel.py (llama)
        pytest.param("gemma3_text", 2, 1, id="tp2-gemma3_text", marks=pytest.mark.slow),
        pytest.param("gemma3_text", 1, 2, id="pp2-gemma3_text", marks=pytest.mark.slow),
        pytest.param("gemma2", 2, 1, id="tp2-gemma2", marks=pytest.mark.slow),
        pytest.param("gemma2", 1, 2, id="pp2-gemma2", marks=pytest.mark.slow),
    ],
)
def test_greedy_parity_with_transformers(models, arch, tp, pp):
    path, reference = models(arch)
    blocks = small_kv_cache(path, SETTINGS["max_model_len"], SETTINGS["max_num_batched_tokens"])
    llm = LLM(str(path), **SETTINGS, num_kv_blocks=blocks, tensor_parallel_size=tp, pipeline_parallel_size=pp)
    try:
        assert llm.engine.ranks is not None and len(llm.engine.ranks.processes) == tp * pp - 1
        assert_greedy_parity(llm, reference, mixed_prompts(llm.engine.setup.hf_config.vocab_size)[::2])
        assert llm.engine.stats().num_preemptions > 0  # the small cache really preempted
    finally:
        llm.shutdown()
