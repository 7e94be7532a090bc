"""Length-dependent rope types through the engine (models/layers/rotary.py), greedy-identical to
transformers generating each request alone: longrope (Phi-3), whose KV is recomputed with the long factors
when a request grows past `original_max_position_embeddings` (transformers' generate drops its cache there),
and dynamic NTK, whose prompt keys stay rotated for the prompt's length; both under chunked prefill and
prefix caching. The static types (linear, yarn, llama3) under -m slow; their frequencies are checked
against transformers in tests/models/test_rotary.py."""

from __future__ import annotations

import pytest
from parity import PHI3_LONGROPE, Reference, assert_greedy_parity, mixed_prompts
from tiny import make_tiny_checkpoint

from pagellm import LLM

MAX_TOKENS = 16


class FreshRopeReference(Reference):
    """transformers' dynamic rope keeps the frequencies of the longest sequence it has seen until a short
    one resets them; here every prompt starts afresh, as if generated alone."""

    def _reset(self) -> None:
        for m in self.model.modules():
            if hasattr(m, "original_inv_freq") and hasattr(m, "max_seq_len_cached"):
                m.register_buffer("inv_freq", m.original_inv_freq.clone(), persistent=False)
                m.max_seq_len_cached = m.original_max_seq_len

    def generate(self, prompt: list[int]) -> list[int]:
        self._reset()
        return super().generate(prompt)

    def logprobs(self, tokens: list[int]):
        self._reset()
        return super().logprobs(tokens)


def test_longrope_recomputes_a_request_that_grows_past_the_threshold(tmp_path):
    path = make_tiny_checkpoint("phi3", tmp_path, **PHI3_LONGROPE)  # short factors up to 32 tokens
    reference = Reference(path, MAX_TOKENS)
    llm = LLM(str(path), dtype="float32", max_model_len=400, max_num_batched_tokens=24, max_num_seqs=8)
    scheduler, outgrown = llm.engine.scheduler, []
    preempt = scheduler._preempt

    def spy(request, **kwargs):
        if kwargs.get("outgrown"):
            outgrown.append(request.request_id)
        preempt(request, **kwargs)

    scheduler._preempt = spy
    prompts = mixed_prompts(300, seed=2, shared_prefix=17)
    # 18 .. 32 tokens: short, then long while generating; 33 and longer: long from the start
    crossing = [p for p in prompts[:9] if len(p) <= 32]
    assert len(crossing) >= 3
    assert_greedy_parity(llm, reference, prompts[:9])
    assert len(outgrown) == len(crossing)
    assert llm.engine.stats().prefix_cache_hits > 0
    assert_greedy_parity(llm, reference, prompts[9:])


def test_dynamic_ntk_keeps_each_prompt_rotated_for_its_length(tmp_path):
    rope = {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0}
    path = make_tiny_checkpoint("llama", tmp_path, max_position_embeddings=64, rope_parameters=rope)
    reference = FreshRopeReference(path, MAX_TOKENS)
    llm = LLM(str(path), dtype="float32", max_num_batched_tokens=40, max_num_seqs=8)
    assert llm.engine.setup.max_model_len == 256  # 64 positions stretched 4 times, as vLLM allows
    # a shared 30-token prefix: prompts up to 64 tokens share its blocks, longer ones are rotated for
    # their own length and must not take them
    prompts = [p for p in mixed_prompts(300, seed=3, shared_prefix=30) if len(p) <= 200]
    assert_greedy_parity(llm, reference, prompts[:1])
    assert_greedy_parity(llm, reference, prompts[1:])
    assert llm.engine.stats().prefix_cache_hits > 0


@pytest.mark.slow
@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 10000.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
            "rope_theta": 500000.0,
        },
    ],
    ids=lambda r: r["rope_type"],
)
def test_static_rope_scaling_types(tmp_path, rope):
    path = make_tiny_checkpoint("llama", tmp_path, max_position_embeddings=400, rope_parameters=rope)
    reference = Reference(path, MAX_TOKENS)
    llm = LLM(str(path), dtype="float32", max_model_len=400, max_num_batched_tokens=40, max_num_seqs=8)
    assert_greedy_parity(llm, reference, mixed_prompts(300))


@pytest.mark.slow
def test_longrope_compiled_forward(tmp_path):
    """torch.compile'd: the length-dependent cos/sin op reads the step's lengths inside the graph."""
    path = make_tiny_checkpoint("phi3", tmp_path, **PHI3_LONGROPE)
    reference = Reference(path, MAX_TOKENS)
    llm = LLM(
        str(path),
        dtype="float32",
        max_model_len=400,
        enforce_eager=False,
        max_num_batched_tokens=64,
        max_num_seqs=8,
    )
    assert llm.engine.runner.forward is not llm.engine.runner.model
    assert_greedy_parity(llm, reference, mixed_prompts(300)[:12])
