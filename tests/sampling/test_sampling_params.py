import math

import pytest

from pagellm.sampling.params import SamplingParams


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p, p.max_tokens) == (1, 1.0, 1.0, 0, 0.0, 16)
    assert p.stop == [] and p.stop_token_ids == [] and p.logit_bias is None
    assert p.output_kind == "cumulative" and p.skip_special_tokens and not p.greedy


@pytest.mark.parametrize(
    "field, value",
    [
        ("n", 0),
        ("temperature", -1),
        ("temperature", math.inf),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("top_k", 2**63),
        ("seed", 2**64),
        ("seed", -(2**63) - 1),
        ("min_p", -0.1),
        ("min_p", 1.1),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -2.5),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", math.inf),
        ("max_tokens", 0),
        ("min_tokens", -1),
        ("logprobs", -1),
        ("logprobs", 21),
        ("prompt_logprobs", 21),
        ("stop", ["ok", ""]),
        ("stop_token_ids", [-3]),
        ("logit_bias", {"5": 101}),
        ("logit_bias", {-1: 1.0}),
        ("output_kind", "sometimes"),
    ],
)
def test_invalid_field_is_named(field, value):
    with pytest.raises(ValueError, match=rf"^{field} .*got"):
        SamplingParams(**{field: value})


def test_error_message_states_the_range():
    with pytest.raises(ValueError, match=r"temperature must be a finite number >= 0, got -1"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match=r"min_tokens must be <= max_tokens \(4\), got 5"):
        SamplingParams(min_tokens=5, max_tokens=4)


def test_each_sample_gets_a_seed_in_range_even_at_the_end_of_the_range():
    params = SamplingParams(n=3, seed=2**64 - 2)
    assert [params.for_sample(i).seed for i in range(3)] == [2**64 - 2, 2**64 - 1, 0]
    assert params.for_sample(1).n == 1 and SamplingParams(n=2).for_sample(1).seed is None


def test_normalisation():
    p = SamplingParams(stop="###", stop_token_ids=(7,), logit_bias={"12": 3, 4: -2.5}, max_tokens=None)
    assert p.stop == ["###"] and p.stop_token_ids == [7]
    assert p.logit_bias == {12: 3.0, 4: -2.5}
    assert SamplingParams(min_tokens=100, max_tokens=None).min_tokens == 100


def test_greedy_and_stop_ids():
    assert SamplingParams(temperature=0).greedy and SamplingParams(temperature=1e-6).greedy
    assert not SamplingParams(temperature=1e-4).greedy
    p = SamplingParams(stop_token_ids=[5])
    assert p.all_stop_token_ids([2]) == {2, 5}
    assert SamplingParams(stop_token_ids=[5], ignore_eos=True).all_stop_token_ids([2]) == {5}


def test_validate_token_ids_against_vocab():
    SamplingParams(stop_token_ids=[9], logit_bias={9: 1}).validate_token_ids(10)
    with pytest.raises(ValueError, match="logit_bias token ids must be < the vocabulary size 10"):
        SamplingParams(logit_bias={10: 1}).validate_token_ids(10)
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=[12]).validate_token_ids(10)


def test_clone_is_independent():
    p = SamplingParams(stop=["a"], logit_bias={1: 1.0})
    q = p.clone()
    q.stop.append("b")
    q.logit_bias[2] = 2.0
    assert (
        p.stop == ["a"]
        and p.logit_bias == {1: 1.0}
        and q == SamplingParams(stop=["a", "b"], logit_bias={1: 1, 2: 2})
    )


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", -1.0),
        ("top_p", 0.0),
        ("top_k", -5),
        ("max_tokens", 0),
        ("min_tokens", -1),
        ("logprobs", -1),
        ("stop_token_ids", [-1]),
        ("logit_bias", {3: 500.0}),
    ],
)
def test_a_refused_setting_names_its_field_in_param(field, value):
    """The server answers 400 with `param` from the error itself, never from parsing its message."""
    from pagellm.core.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        SamplingParams(**{field: value})
    assert info.value.param == field


def test_token_ids_beyond_the_vocabulary_name_their_field():
    from pagellm.core.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        SamplingParams(logit_bias={70000: 1.0}).validate_token_ids(1000)
    assert info.value.param == "logit_bias"
