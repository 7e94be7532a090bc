"""EAGLE-3 speculative decoding: greedy tokens equal transformers' with a random head in either layout,
and the head's drafts equal a cache-free reference's (so its KV stays right through chunked prefill,
prefix-cache hits and preemption); heads that cannot run are refused at start-up."""

from __future__ import annotations

import json

import pytest
from eagle_heads import ReferenceHead, write_eagle3_head, write_speculators_head
from hybrid_checks import chi_square_p_below_0_1_percent
from parity import Reference, assert_greedy_parity, mixed_prompts
from test_spec_engine import copy_friendly_prompts
from tiny import make_tiny_checkpoint

from pagellm import LLM
from pagellm.core.errors import ConfigError

MAX_TOKENS = 16


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = make_tiny_checkpoint("llama", tmp_path_factory.mktemp("llama"), num_hidden_layers=4)
    return path, Reference(path, MAX_TOKENS)


def vocab_of(path) -> int:
    return json.loads((path / "config.json").read_text())["vocab_size"]


@pytest.fixture(scope="module", params=["speculators", "eagle3"])
def head(request, target, tmp_path_factory):
    """(directory, auxiliary layers) of a random head: speculators' with its own layers and embedding,
    EAGLE-3's with vLLM's default layers (2, L // 2, L - 3) and the target's embedding."""
    out = tmp_path_factory.mktemp(request.param) / "head"
    vocab = vocab_of(target[0])
    if request.param == "speculators":
        return write_speculators_head(out, vocab, 96, aux_ids=(0, 1, 3)), (0, 1, 3)
    return write_eagle3_head(out, vocab, 128), (2, 2, 1)


def engine(path, head_dir, k=3, **overrides) -> LLM:
    settings = dict(
        dtype="float32", num_kv_blocks=400, max_model_len=400,
        speculative_config={"method": "eagle3", "model": str(head_dir), "num_speculative_tokens": k},
    )  # fmt: skip
    settings.update(overrides)
    return LLM(str(path), **settings)


def recorded_drafts(llm: LLM) -> list[tuple[list[int], list[int]]]:
    """Every (tokens, drafts) the engine's proposer returns from now on."""
    proposer = llm.engine.runner.spec_decode.proposer
    propose, records = proposer.propose, []

    def recording(requests):
        drafts = propose(requests)
        records.extend((list(r.token_ids), d) for r, d in zip(requests, drafts, strict=True) if d)
        return drafts

    proposer.propose = recording
    return records


def test_greedy_tokens_and_drafts_match_the_references_through_chunking_caching_and_preemption(target, head):
    """The shared prefix is a block and one token, so a prefix-cache hit's last head row (whose successor
    is the token after the hit) is the same for every prompt sharing it."""
    path, reference = target
    head_dir, aux_ids = head
    prompts = mixed_prompts(300, seed=1, shared_prefix=17) + copy_friendly_prompts(300, seed=1)
    llm = engine(
        path, head_dir, k=3, max_num_batched_tokens=48, max_num_seqs=8, num_kv_blocks=30, max_model_len=368
    )
    records = recorded_drafts(llm)
    assert_greedy_parity(llm, reference, prompts)
    assert_greedy_parity(llm, reference, prompts[:6])  # again, from the prefix cache
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert stats.spec_num_draft_tokens > 0
    embed = reference.model.model.embed_tokens.weight.detach()
    ref = ReferenceHead(head_dir, reference.model, aux_ids, embed)
    for tokens, drafts in records[:: max(1, len(records) // 40)]:
        for j, logits in enumerate(ref.draft_logits(tokens, drafts)):
            assert logits[drafts[j]] >= logits.max() - 1e-3, (len(tokens), j)


def test_a_head_for_another_vocabulary_is_refused_at_start_up(target, tmp_path):
    head_dir = write_speculators_head(tmp_path / "head", vocab_of(target[0]) + 8, 96, aux_ids=(0, 1, 3))
    with pytest.raises(ConfigError, match="vocabulary"):
        engine(target[0], head_dir)


def test_auxiliary_layers_outside_the_target_are_refused_at_start_up(target, tmp_path):
    head_dir = write_speculators_head(tmp_path / "head", vocab_of(target[0]), 96, aux_ids=(0, 1, 9))
    with pytest.raises(ConfigError, match="auxiliary hidden state layers"):
        engine(target[0], head_dir)


def test_sampling_with_an_eagle3_head_keeps_the_target_distribution(target, tmp_path):
    """3,000 seeded requests of 3 tokens at temperature 0.5, drafting 2: given the likeliest first token
    t1, the second must follow the target's p(. | prompt, t1) (chi-square below its 0.1% critical value).
    The head always drafts that distribution's likeliest token, so drafts are accepted often and rejected
    often (accepted: the draft token; rejected: a draw from p without it)."""
    import numpy as np
    import torch

    from pagellm import SamplingParams

    path, reference = target
    prompt, temperature = list(range(5, 13)), 0.5
    with torch.no_grad():
        p1 = (reference.model(torch.tensor([prompt])).logits[0, -1] / temperature).softmax(-1)
        t1 = int(p1.argmax())
        p2 = (reference.model(torch.tensor([prompt + [t1]])).logits[0, -1] / temperature).softmax(-1).numpy()
    head_dir = write_speculators_head(
        tmp_path / "head", vocab_of(path), 96, (0, 1, 3), always=int(p2.argmax())
    )
    llm = engine(path, head_dir, k=2, max_num_seqs=256, num_kv_blocks=2000, max_model_len=64)
    params = [SamplingParams(temperature=temperature, max_tokens=3, seed=i) for i in range(3000)]
    outs = llm.generate([prompt] * len(params), params, use_tqdm=False)
    seconds = [o.outputs[0].token_ids[1] for o in outs if o.outputs[0].token_ids[0] == t1]
    observed = np.bincount(seconds, minlength=len(p2)).astype(float)
    accepted = observed[int(p2.argmax())] / len(seconds)  # a rejected draft is never drawn again
    assert len(seconds) > 500 and 0.1 < accepted < 0.9 and llm.engine.stats().spec_num_draft_tokens > 0
    assert chi_square_p_below_0_1_percent(observed, p2) is False
    point_mass = np.eye(len(p2))[int(p2.argmax())] * 0.999 + 0.001 / len(p2)  # and the test can fail
    assert chi_square_p_below_0_1_percent(observed, point_mass) is True


def test_a_grammar_and_a_lora_adapter_keep_the_greedy_output(target, head, tmp_path):
    """Under a JSON schema the scheduler trims drafts to what the grammar admits; under an adapter the head
    reads the adapted target's hidden states. Neither changes the tokens, only how many drafts count."""
    import importlib.util
    from pathlib import Path

    from pagellm import LoRARequest, SamplingParams, StructuredOutputsParams

    path, _ = target
    head_dir, _ = head
    spec = importlib.util.spec_from_file_location(
        "lora_helpers", Path(__file__).parents[1] / "lora" / "test_lora.py"
    )
    lora_helpers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lora_helpers)
    adapter, _ = lora_helpers.make_adapter(path, tmp_path, rank=4, seed=5)
    lora = LoRARequest("a", 1, str(adapter))
    grammar = StructuredOutputsParams(
        json={"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]},
        disable_any_whitespace=True,
    )
    prompts = [{"prompt_token_ids": p} for p in copy_friendly_prompts(300, seed=4)]
    runs = []
    for speculative in (None, {"method": "eagle3", "model": str(head_dir), "num_speculative_tokens": 3}):
        llm = LLM(str(path), dtype="float32", num_kv_blocks=200, max_model_len=200, enable_lora=True,
                  max_loras=1, max_lora_rank=4, speculative_config=speculative)  # fmt: skip
        tokens = []
        for params, adapter_request in (
            (SamplingParams(temperature=0, max_tokens=24, structured_outputs=grammar), None),
            (SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True), lora),
        ):
            outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=adapter_request)
            tokens.append([o.outputs[0].token_ids for o in outputs])
        runs.append(tokens)
    assert runs[0] == runs[1]
    assert llm.engine.stats().spec_num_draft_tokens > 0


def test_eagle3_without_a_head_or_with_a_split_target_is_refused(target, head):
    from pagellm.core.config import SpeculativeConfig

    with pytest.raises(ConfigError, match="EAGLE-3 head's directory"):
        SpeculativeConfig.parse({"method": "eagle3", "num_speculative_tokens": 2})
    with pytest.raises(ConfigError, match="EAGLE-3 head .* tensor or pipeline parallelism"):
        engine(target[0], head[0], tensor_parallel_size=2)


def test_the_target_runs_eagerly_with_a_head_even_where_it_would_compile(target, head):
    """A compiled forward would not call the layer hooks the head reads through; the runner keeps it eager."""
    path, reference = target
    llm = engine(path, head[0], enforce_eager=False)
    assert not llm.engine.config.enforce_eager and llm.engine.runner.forward is llm.engine.runner.model
    assert_greedy_parity(llm, reference, copy_friendly_prompts(300, seed=5)[:1])
