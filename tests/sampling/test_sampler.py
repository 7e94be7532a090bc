import pytest
import torch

from pagellm.sampling.params import SamplingParams
from pagellm.sampling.penalties import apply_penalties
from pagellm.sampling.sampler import (
    Sampler,
    SamplingRequest,
    build_sampling_batch,
    compute_prompt_logprobs,
    make_generator,
)

EOS = 5
LOGITS = torch.tensor([1.0, 2.0, 0.5, -1.0, 1.5, 0.0])


def _sample(logits, params_list, outputs=None, prompts=None, sampler=None):
    requests = [
        SamplingRequest(p, (prompts or {}).get(i, [0]), (outputs or {}).get(i, []), make_generator(p, "cpu"))
        for i, p in enumerate(params_list)
    ]
    return (sampler or Sampler())(logits, build_sampling_batch(requests, [EOS], "cpu"))


def _empirical(params, n=20_000, seed=0):
    logits = LOGITS.repeat(n, 1)
    out = _sample(logits, [params] * n, sampler=Sampler(torch.Generator().manual_seed(seed)))
    return torch.bincount(out.token_ids, minlength=6).float() / n


def _renormalised(probs, keep):
    probs = torch.where(keep, probs, torch.zeros_like(probs))
    return probs / probs.sum()


def test_greedy_is_argmax_and_fast():
    logits = torch.randn(4, 50)
    batch = build_sampling_batch([SamplingRequest(SamplingParams(temperature=0), [1], [])] * 4, [EOS], "cpu")
    assert batch.plain_greedy and batch.temperature is None and batch.top_k is None
    out = Sampler()(logits, batch)
    assert torch.equal(out.token_ids, logits.argmax(-1)) and out.logprobs is None


def test_penalties_match_hand_computation():
    logits = torch.tensor([[2.0, -1.0, 0.5, 1.0, -2.0, 0.0]])
    prompt, output = torch.tensor([[0, 1, -1]]), torch.tensor([[3, 3, 4]])
    got = apply_penalties(
        logits.clone(), prompt, output, torch.tensor([0.5]), torch.tensor([0.25]), torch.tensor([2.0])
    )
    # repetition over {0, 1, 3, 4}: positive / 2, negative * 2; then 3 (twice) and 4 (once) in the output:
    # -0.25 * count - 0.5.
    assert torch.allclose(got, torch.tensor([[1.0, -2.0, 0.5, -0.5, -4.75, 0.0]]))


def test_penalties_apply_to_their_rows_only():
    logits = torch.tensor([[3.0, 2.9, 0.0], [3.0, 2.9, 0.0]])
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0, presence_penalty=0.5)]
    out = _sample(logits, params, outputs={0: [0], 1: [0]})
    assert out.token_ids.tolist() == [0, 1]
    out = _sample(
        logits, [SamplingParams(temperature=0, repetition_penalty=2.0)] * 2, prompts={0: [2], 1: [0]}
    )
    assert out.token_ids.tolist() == [0, 1]


def test_logit_bias_and_min_tokens():
    logits = torch.zeros(3, 8)
    logits[:, EOS] = 5.0
    params = [
        SamplingParams(temperature=0, logit_bias={"2": 10}),
        SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[6]),
        SamplingParams(temperature=0, min_tokens=2),
    ]
    logits[1, 6] = 4.0
    out = _sample(logits, params, outputs={1: [1], 2: [1, 1]})
    # row 1 is under min_tokens: neither EOS nor its stop token; row 2 has reached it.
    assert out.token_ids[0] == 2 and out.token_ids[1] not in (EOS, 6) and out.token_ids[2] == EOS


@pytest.mark.parametrize(
    "params, expected",
    [
        (SamplingParams(), LOGITS.softmax(-1)),
        (SamplingParams(temperature=0.5), (LOGITS / 0.5).softmax(-1)),
        (SamplingParams(temperature=2.0, top_k=-1), (LOGITS / 2).softmax(-1)),
        (SamplingParams(top_k=3), _renormalised(LOGITS.softmax(-1), LOGITS >= 1.0)),
        (SamplingParams(top_k=100), LOGITS.softmax(-1)),
        # probs sorted: 2.0, 1.5, 1.0, 0.5, 0.0, -1.0 -> 0.39, 0.24, 0.14, 0.09, 0.05, 0.02;
        # after top_k=4: 0.46, 0.28, 0.17, 0.10
        (SamplingParams(top_p=0.7), _renormalised(LOGITS.softmax(-1), LOGITS >= 1.0)),
        (SamplingParams(top_p=0.6), _renormalised(LOGITS.softmax(-1), LOGITS >= 1.5)),
        (SamplingParams(top_k=4, top_p=0.85), _renormalised(LOGITS.softmax(-1), LOGITS >= 1.0)),
        (SamplingParams(min_p=0.3), _renormalised(LOGITS.softmax(-1), LOGITS >= 1.0)),
        (
            SamplingParams(temperature=0.5, min_p=0.3),
            _renormalised((LOGITS / 0.5).softmax(-1), LOGITS >= 1.5),
        ),
    ],
)
def test_empirical_distribution(params, expected):
    assert (_empirical(params) - expected).abs().max() < 0.015


def test_mixed_batch_rows_keep_their_own_settings():
    logits = LOGITS.repeat(4000, 1)
    params = [
        SamplingParams(temperature=0),
        SamplingParams(top_k=1),
        SamplingParams(min_p=0.9),
        SamplingParams(),
    ]
    out = _sample(logits, params * 1000).token_ids.view(1000, 4)
    assert (out[:, :3] == 1).all()
    assert len(out[:, 3].unique()) == 6


def _run_steps(params_list, steps=8, vocab=50):
    """Decode `steps` steps; row logits depend only on the row's seed so the seeded one can be compared."""
    requests = [SamplingRequest(p, [1, 2, 3], [], make_generator(p, "cpu")) for p in params_list]
    sampler = Sampler()
    for step in range(steps):
        logits = torch.stack(
            [
                torch.randn(vocab, generator=torch.Generator().manual_seed(1000 * step + (p.seed or 0)))
                for p in params_list
            ]
        )
        out = sampler(logits, build_sampling_batch(requests, [EOS], "cpu"))
        for r, t in zip(requests, out.token_ids.tolist(), strict=True):
            r.output_token_ids = [*r.output_token_ids, t]
    return [r.output_token_ids for r in requests]


def test_seeded_request_is_independent_of_its_batch():
    seeded = SamplingParams(seed=7, top_p=0.95, presence_penalty=0.3)
    alone = _run_steps([seeded])[0]
    torch.manual_seed(123)
    batched = _run_steps([SamplingParams(), SamplingParams(seed=8), seeded, SamplingParams(temperature=0)])
    assert batched[2] == alone
    assert batched[1] != alone
    torch.manual_seed(456)
    assert _run_steps([SamplingParams(seed=3), seeded])[1] == alone


def test_logprobs_come_from_raw_logits():
    torch.manual_seed(0)
    logits = torch.randn(3, 10)
    params = [
        SamplingParams(temperature=0, logprobs=3, logit_bias={9: 100}),
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=0, logprobs=0),
    ]
    out = _sample(logits, params)
    raw = logits.log_softmax(-1)
    ids = out.token_ids
    assert ids[0] == 9
    lp = out.logprobs
    assert torch.allclose(lp.token_logprobs, raw.gather(1, ids[:, None]).squeeze(1))
    order = raw.argsort(dim=-1, descending=True)
    expected_ranks = (order == ids[:, None]).nonzero()[:, 1] + 1
    assert torch.equal(lp.token_ranks, expected_ranks)
    assert lp.token_ranks[2] == 1
    assert lp.topk_ids.shape == (3, 3)
    assert torch.equal(lp.topk_ids, order[:, :3])
    assert torch.allclose(lp.topk_logprobs, raw.gather(1, order[:, :3]))


def test_prompt_logprobs():
    logits = torch.randn(4, 12)
    targets = torch.tensor([3, 0, 11, 5])
    lp = compute_prompt_logprobs(logits, targets, 2)
    raw = logits.log_softmax(-1)
    assert torch.allclose(lp.token_logprobs, raw[torch.arange(4), targets])
    assert torch.equal(lp.topk_ids, raw.topk(2).indices)
    assert ((raw >= lp.token_logprobs[:, None]).sum(-1) == lp.token_ranks).all()


def test_argmax_matches_torch_argmax_with_ties():
    from pagellm.sampling.sampler import argmax

    logits = torch.randn(64, 5000, generator=torch.Generator().manual_seed(0))
    logits[3, [10, 20, 4000]] = 50.0  # a three-way tie: the first wins
    logits[5] = 1.0  # all equal
    assert argmax(logits).tolist() == logits.argmax(dim=-1).tolist()
    assert argmax(logits)[3] == 10 and argmax(logits)[5] == 0


def test_greedy_rows_use_the_argmax_it_is_given():
    """The model runner hands the sampler its platform's argmax (the CPU's native one)."""
    calls = []

    def argmax(logits):
        calls.append(logits.shape)
        return logits.max(dim=-1).indices

    sampler = Sampler(argmax=argmax)
    logits = torch.randn(3, 11)
    batch = build_sampling_batch(
        [SamplingRequest(SamplingParams(temperature=0.0), [1], [], None, None)] * 3, set(), "cpu"
    )
    assert torch.equal(sampler(logits, batch).token_ids, logits.argmax(dim=-1))
    assert calls == [(3, 11)]
