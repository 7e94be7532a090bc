"""The pieces of speculative decoding on their own: n-gram lookup, the rejection sampler against the exact
distribution it must keep, and the scheduler's bookkeeping of drafts."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagellm.core.config import EngineConfig, SpeculativeConfig
from pagellm.core.errors import ConfigError
from pagellm.engine.request import Request
from pagellm.engine.scheduler import Scheduler
from pagellm.sampling.params import SamplingParams
from pagellm.sampling.sampler import Sampler, SamplingRequest, build_sampling_batch
from pagellm.spec_decode.ngram import NgramProposer, ngram_lookup
from pagellm.spec_decode.proposer import DraftRequest
from pagellm.spec_decode.rejection import verify

# -- config ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value, message",
    [
        ({"method": "eagle9", "num_speculative_tokens": 2}, "method"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram"}, "num_speculative_tokens"),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 3},
            "exceed",
        ),
        ({"method": "ngram", "num_speculative_tokens": 2, "draft": 1}, "unknown key"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
        ('{"method": ', "JSON"),
        ("[1, 2]", "JSON object"),
    ],
)
def test_bad_speculative_configs_say_what_is_wrong(value, message):
    with pytest.raises(ConfigError, match=message):
        SpeculativeConfig.parse(value)


def test_speculative_config_from_json_and_defaults():
    spec = EngineConfig(speculative_config='{"method": "ngram", "num_speculative_tokens": 3}').speculative
    assert (spec.method, spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max) == (
        "ngram", 3, 2, 4,
    )  # fmt: skip
    only_max = EngineConfig(
        speculative_config={"method": "ngram", "num_speculative_tokens": 1, "prompt_lookup_max": 7}
    )
    assert (only_max.speculative.prompt_lookup_min, only_max.speculative.prompt_lookup_max) == (7, 7)
    assert EngineConfig().speculative is None


# -- n-gram ---------------------------------------------------------------------------------------------


def test_ngram_proposes_what_followed_the_longest_earlier_match():
    tokens = np.array([1, 2, 3, 4, 5, 9, 2, 3, 4, 6, 7, 1, 2, 3, 4])
    # the suffix 2 3 4 first occurs at 1, followed by 5 9 2 ...
    assert ngram_lookup(tokens, 1, 3, 3) == [5, 9, 2]
    # with only 1-grams: the first earlier 4 is followed by 5
    assert ngram_lookup(tokens, 1, 1, 2) == [5, 9]
    # a suffix that never occurred before: nothing
    assert ngram_lookup(np.array([1, 2, 3, 8]), 1, 3, 4) == []
    # a match near the end proposes fewer than k
    assert ngram_lookup(np.array([5, 6, 5]), 1, 2, 4) == [6, 5]
    # a prompt that repeats one word: the word again, k times
    assert ngram_lookup(np.array([42] * 10), 2, 4, 4) == [42] * 4


def test_ngram_proposer_respects_each_requests_budget():
    proposer = NgramProposer(1, 2)
    requests = [DraftRequest("a", [1, 2, 3, 1, 2], 1), DraftRequest("b", [1, 2, 3, 1, 2], 0)]
    assert proposer.propose(requests) == [[3], []]


# -- the rejection sampler ------------------------------------------------------------------------------


def _batch(params: SamplingParams, rows: int, generator=None):
    return build_sampling_batch([SamplingRequest(params, [0], [], generator)] * rows, [], "cpu")


def test_greedy_accepts_while_drafts_equal_the_argmax_then_adds_the_targets_token():
    logits = torch.full((4, 6), -5.0)
    for row, best in enumerate([3, 1, 4, 2]):
        logits[row, best] = 5.0
    params = SamplingParams(temperature=0)
    sampler = Sampler()
    assert verify(sampler, logits, _batch(params, 4), [[3, 1, 4]], [True], [None]) == [[3, 1, 4, 2]]  # bonus
    assert verify(sampler, logits, _batch(params, 4), [[3, 0, 4]], [True], [None]) == [[3, 1]]
    assert verify(sampler, logits, _batch(params, 4), [[5, 1, 4]], [True], [None]) == [[3]]
    assert verify(sampler, logits[:1], _batch(params, 1), [[]], [True], [None]) == [[3]]


def test_random_sampling_with_drafts_keeps_the_target_distribution():
    """Two drafts on a 5-token vocabulary, 20,000 seeded draws: the first token must follow p0 and, when
    the first draft was accepted, the second must follow p1 (chi-square with 4 degrees of freedom below
    18.47, its 0.1% critical value, at a fixed seed)."""
    logits = torch.tensor([[1.0, 0.2, -0.5, 0.7, 0.0], [0.1, 1.5, -1.0, 0.3, 0.4], [0.0, 0.0, 0.0, 0.0, 2.0]])
    p = logits.softmax(-1)
    drafts = [1, 3]  # the first is unlikely (p0[1] ~ 0.17), so both branches get exercised
    params = SamplingParams(temperature=1.0, seed=3)
    generator = torch.Generator().manual_seed(1234)
    sampler = Sampler(torch.Generator().manual_seed(99))
    first, second = np.zeros(5), np.zeros(5)
    trials = 20_000
    for _ in range(trials):
        (tokens,) = verify(sampler, logits, _batch(params, 3, generator), [drafts], [False], [generator])
        first[tokens[0]] += 1
        if tokens[0] == drafts[0]:
            second[tokens[1]] += 1
    assert _chi_square(first, p[0].numpy() * trials) < CHI2_4DF_0_1_PERCENT
    assert second.sum() > 2_000
    assert _chi_square(second, p[1].numpy() * second.sum()) < CHI2_4DF_0_1_PERCENT
    # and the statistic can fail: the draft's own (point-mass) distribution is far from p0
    assert _chi_square(first, np.eye(5)[1] * trials * 0.999 + trials * 0.0002) > CHI2_4DF_0_1_PERCENT


CHI2_4DF_0_1_PERCENT = 18.47


def _chi_square(observed: np.ndarray, expected: np.ndarray) -> float:
    return float(((observed - expected) ** 2 / expected).sum())


def test_a_seeded_draw_depends_only_on_its_own_generator():
    logits = torch.randn(3, 50)
    params = SamplingParams(temperature=0.8, seed=5)

    def run(seed):
        g = torch.Generator().manual_seed(seed)
        return verify(
            Sampler(torch.Generator().manual_seed(0)), logits, _batch(params, 3, g), [[7, 8]], [False], [g]
        )

    assert run(11) == run(11)


# -- the scheduler ----------------------------------------------------------------------------------------


def _sched(**kw):
    args = dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128, block_size=4, num_blocks=64)
    args.update(kw)
    return Scheduler(**args)


def _decoding(s: Scheduler, prompt_len=8) -> Request:
    r = Request("a", list(range(prompt_len)), SamplingParams(max_tokens=50), ())
    s.add_request(r)
    out = s.schedule()
    s.update_from_output(out, {"a": [100]}, {"a": [101, 102, 103]})
    return r


def test_drafts_are_scheduled_after_the_last_token_and_rejected_ones_rolled_back():
    s = _sched()
    r = _decoding(s)
    assert r.spec_token_ids == [101, 102, 103] and r.num_computed_tokens == 8
    out = s.schedule()
    assert out.num_scheduled_tokens["a"] == 4 and out.spec_token_ids["a"] == [101, 102, 103]
    s.update_from_output(out, {"a": [101, 55]}, {"a": [9]})  # one accepted, then the target's 55
    assert r.output_token_ids == [100, 101, 55]
    assert r.num_computed_tokens == 10  # the prompt, 100 and 101; 55's KV comes next step
    assert r.spec_token_ids == [9]
    stats = s.stats()
    assert (stats.spec_num_drafts, stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens) == (1, 3, 1)
    assert stats.spec_accepted_per_position == (1, 0, 0)


def test_drafts_count_against_the_token_budget_and_are_trimmed():
    s = _sched(max_num_batched_tokens=10, max_num_seqs=2)
    r = _decoding(s)
    other = Request("b", list(range(50, 58)), SamplingParams(max_tokens=5), ())
    s.add_request(other)
    r.spec_token_ids = list(range(101, 121))  # 20 drafts, far over the budget
    out = s.schedule()
    assert out.num_scheduled_tokens["a"] == 10 and len(out.spec_token_ids["a"]) == 9
    assert "b" not in out.num_scheduled_tokens  # the budget is spent
    assert out.total_num_scheduled_tokens == 10


def test_blocks_of_rejected_drafts_never_reach_the_prefix_cache():
    s = _sched(block_size=4)
    r = _decoding(s, prompt_len=7)  # tokens 0..6 and 100: two full blocks, KV for 7
    out = s.schedule()
    s.update_from_output(out, {"a": [77]}, {})  # every draft rejected
    assert r.num_computed_tokens == 8 and r.all_token_ids[8] == 77
    cached = s.kv_cache_manager._num_cached["a"]
    assert cached == 2  # blocks 0-1 (tokens 0..7); the block holding rejected drafts 102, 103 is not
    probe = Request("p", r.all_token_ids[:8] + [102, 103, 0, 0, 1], SamplingParams(max_tokens=1), ())
    blocks, hit = s.kv_cache_manager.get_computed_blocks(probe)
    assert hit == 8


def test_a_preempted_request_drops_its_drafts():
    s = _sched()
    r = _decoding(s)
    s._preempt(s.running.pop())
    assert r.spec_token_ids == [] and r.num_computed_tokens == 0


def test_lookahead_slots_are_allocated_for_a_draft_models_kv():
    s = _sched(block_size=4, num_lookahead_tokens=3)
    r = Request("a", list(range(8)), SamplingParams(max_tokens=5), ())
    s.add_request(r)
    s.schedule()
    assert len(s.kv_cache_manager.block_table("a")) == 3  # 8 tokens + 3 lookahead slots
