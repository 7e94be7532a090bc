"""The offline LLM API: inputs, outputs, sampling through the engine, errors, and no leaked KV blocks."""

from __future__ import annotations

import json

import pytest
import torch
from tiny import EOS_ID, make_tiny_checkpoint

from pagellm import LLM, SamplingParams
from pagellm.core.errors import ConfigError


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("api"))


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(str(model_dir), dtype="float32", num_kv_blocks=200, max_model_len=256)


def assert_no_leaks(llm: LLM) -> None:
    kv = llm.engine.scheduler.kv_cache_manager
    assert not llm.engine.has_unfinished_requests()
    assert kv.num_free_blocks == llm.engine.runner.num_blocks - 1  # block 0 is the reserved null block


def test_prompt_forms_and_output_fields(llm):
    tok = llm.get_tokenizer()
    ids = tok.encode("Hello, world!")
    greedy = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    by_text, by_ids = llm.generate(["Hello, world!", {"prompt_token_ids": ids}], greedy, use_tqdm=False)
    assert by_text.prompt == "Hello, world!" and by_text.prompt_token_ids == ids
    assert (
        by_text.outputs[0].token_ids == by_ids.outputs[0].token_ids and len(by_ids.outputs[0].token_ids) == 5
    )
    out = by_text.outputs[0]
    assert out.index == 0 and out.finish_reason == "length" and out.stop_reason is None and by_text.finished
    assert out.text == tok.decode(out.token_ids)
    m = by_text.metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
    single = llm.generate("Hello, world!", greedy, use_tqdm=False)
    assert single[0].outputs[0].token_ids == out.token_ids
    assert_no_leaks(llm)


def test_one_params_per_prompt_and_n(llm):
    outs = llm.generate(
        ["a", "b"],
        [
            SamplingParams(max_tokens=3, ignore_eos=True),
            SamplingParams(n=3, max_tokens=4, seed=7, ignore_eos=True),
        ],
        use_tqdm=False,
    )
    assert len(outs[0].outputs) == 1 and len(outs[0].outputs[0].token_ids) == 3
    assert [o.index for o in outs[1].outputs] == [0, 1, 2]
    assert all(len(o.token_ids) == 4 for o in outs[1].outputs)
    with pytest.raises(ValueError, match="2 sampling_params for 3 prompts"):
        llm.generate(["a", "b", "c"], [SamplingParams(), SamplingParams()])
    assert_no_leaks(llm)


def test_seeded_sampling_is_the_same_alone_and_in_a_batch(llm):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=12, ignore_eos=True)
    alone = llm.generate("The quick brown fox", seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)] * 3
    batch = llm.generate(
        ["Hello", "The quick brown fox", "Once upon a time", "def add(a, b):"],
        [others[0], seeded, others[1], others[2]],
        use_tqdm=False,
    )
    assert batch[1].outputs[0].token_ids == alone


def test_stop_strings_and_stop_tokens(llm):
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    full = llm.generate("Paged attention", greedy, use_tqdm=False)[0].outputs[0]
    stop = full.text[3:6]
    cut = llm.generate(
        "Paged attention",
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=stop),
        use_tqdm=False,
    )[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == full.text[: full.text.index(stop)]
    token = full.token_ids[4]
    by_id = llm.generate(
        "Paged attention",
        SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[token]),
        use_tqdm=False,
    )[0].outputs[0]
    first = full.token_ids.index(token)
    assert by_id.token_ids == full.token_ids[: first + 1] and by_id.stop_reason == token
    assert_no_leaks(llm)


def test_eos_stops_unless_ignored(llm):
    bias = SamplingParams(temperature=0, max_tokens=8, logit_bias={EOS_ID: 100.0})
    out = llm.generate("Hi", bias, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [EOS_ID] and out.finish_reason == "stop" and out.text == ""
    ignored = SamplingParams(temperature=0, max_tokens=3, logit_bias={EOS_ID: 100.0}, ignore_eos=True)
    assert llm.generate("Hi", ignored, use_tqdm=False)[0].outputs[0].token_ids == [EOS_ID] * 3


def test_logprobs_and_prompt_logprobs_match_transformers(llm, model_dir):
    from transformers import AutoModelForCausalLM

    ids = llm.get_tokenizer().encode("Once upon a time there was")
    out = llm.generate(
        {"prompt_token_ids": ids},
        SamplingParams(temperature=0, max_tokens=2, logprobs=3, prompt_logprobs=1, ignore_eos=True),
        use_tqdm=False,
    )[0]
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        logprobs = ref(torch.tensor([ids])).logits[0].log_softmax(-1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    for pos in range(1, len(ids)):
        entry = out.prompt_logprobs[pos][ids[pos]]
        assert entry.logprob == pytest.approx(float(logprobs[pos - 1, ids[pos]]), abs=1e-4)
    first = out.outputs[0].logprobs[0]
    token = out.outputs[0].token_ids[0]
    assert first[token].rank == 1 and first[token].logprob == pytest.approx(
        float(logprobs[-1].max()), abs=1e-4
    )
    assert len(first) == 3


def test_invalid_input_is_rejected_before_anything_runs(llm):
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ConfigError, match="prompt has 300 tokens but this model's context is 256"):
        llm.generate(["ok", {"prompt_token_ids": [5] * 300}], SamplingParams(max_tokens=1))
    with pytest.raises(ConfigError, match="lower max_tokens to at most 246"):
        llm.generate({"prompt_token_ids": [5] * 10}, SamplingParams(max_tokens=250))
    with pytest.raises(ConfigError, match="out of range"):
        llm.generate({"prompt_token_ids": [10**6]}, SamplingParams(max_tokens=1))
    with pytest.raises(ConfigError, match="empty"):
        llm.generate({"prompt_token_ids": []}, SamplingParams(max_tokens=1))
    assert_no_leaks(llm)  # nothing of the valid first prompt was queued


def test_abort_frees_blocks_in_any_state(llm):
    engine = llm.engine
    params = SamplingParams(max_tokens=50, ignore_eos=True)
    running = engine.add_request({"prompt_token_ids": list(range(3, 100))}, params)
    engine.step()
    waiting = engine.add_request({"prompt_token_ids": list(range(3, 60))}, params)
    assert engine.abort_request(running).outputs[0].finish_reason == "abort"
    engine.abort_request(waiting)
    assert_no_leaks(llm)


def test_chat_uses_the_chat_template(llm):
    messages = [{"role": "user", "content": "Hello"}]
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
    expected = llm.get_tokenizer().apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert llm.get_tokenizer().decode(out.prompt_token_ids) == expected
    two = llm.chat(
        [messages, messages], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False
    )
    assert [o.outputs[0].token_ids for o in two] == [out.outputs[0].token_ids] * 2


def test_generation_config_defaults(tmp_path):
    path = make_tiny_checkpoint("llama", tmp_path)
    config = json.loads((path / "generation_config.json").read_text())
    config.update(temperature=0.25, top_k=7)
    (path / "generation_config.json").write_text(json.dumps(config))
    llm = LLM(str(path), dtype="float32", num_kv_blocks=64, max_model_len=256)
    defaults = llm.engine.default_sampling_params()
    assert (defaults.temperature, defaults.top_k) == (0.25, 7)
    plain = LLM(str(path), dtype="float32", num_kv_blocks=64, max_model_len=256, generation_config="pagellm")
    assert plain.engine.default_sampling_params().temperature == 1.0


def test_unknown_engine_setting_is_an_error(model_dir):
    with pytest.raises(ConfigError, match="unknown engine setting"):
        LLM(str(model_dir), blocksize=16)


def test_delta_outputs_rebuild_the_cumulative_ones(llm):
    engine = llm.engine
    common = dict(n=2, seed=3, max_tokens=6, ignore_eos=True)
    cumulative = llm.generate("Hello", SamplingParams(**common), use_tqdm=False)[0]
    request_id = engine.add_request("Hello", SamplingParams(**common, output_kind="delta"))
    texts, tokens, finished = ["", ""], [[], []], set()
    while len(finished) < 2:
        for output in engine.step():
            assert output.request_id == request_id
            for sample in output.outputs:
                assert sample.index not in finished  # a finished sample is not repeated
                texts[sample.index] += sample.text
                tokens[sample.index] += sample.token_ids
                if sample.finish_reason is not None:
                    finished.add(sample.index)
    assert tokens == [o.token_ids for o in cumulative.outputs]
    assert texts == [o.text for o in cumulative.outputs]


def test_final_only_emits_one_output_when_the_request_finishes(llm):
    engine = llm.engine
    common = dict(n=2, seed=3, max_tokens=6, ignore_eos=True, logprobs=2, stop=["\n\n\n"])
    cumulative = llm.generate("Hello", SamplingParams(**common), use_tqdm=False)[0]
    request_id = engine.add_request("Hello", SamplingParams(**common, output_kind="final_only"))
    outputs, steps = [], 0
    while engine.has_unfinished_requests():
        outputs += engine.step()
        steps += 1
    assert steps > 1 and len(outputs) == 1  # nothing while it ran
    (final,) = outputs
    assert final.request_id == request_id and final.finished
    assert [(o.token_ids, o.text, o.finish_reason) for o in final.outputs] == [
        (o.token_ids, o.text, o.finish_reason) for o in cumulative.outputs
    ]
    assert [len(o.logprobs) for o in final.outputs] == [6, 6]
    assert_no_leaks(llm)


def test_final_only_abort_returns_what_ran(llm):
    engine = llm.engine
    request_id = engine.add_request(
        "Hello", SamplingParams(max_tokens=50, ignore_eos=True, output_kind="final_only")
    )
    assert engine.step() == [] and engine.step() == []
    aborted = engine.abort_request(request_id)
    assert aborted.finished and aborted.outputs[0].finish_reason == "abort"
    assert len(aborted.outputs[0].token_ids) >= 1
    assert_no_leaks(llm)


def test_each_prompt_is_processed_once(llm, monkeypatch):
    """`LLM.generate` checks every prompt before queueing any, and that check is the processing: each
    prompt is tokenized (and its grammar checked) once, not once to validate and again to queue."""
    processor = llm.engine.processor
    calls = []
    read_prompt = processor.read_prompt
    monkeypatch.setattr(processor, "read_prompt", lambda prompt: calls.append(prompt) or read_prompt(prompt))
    prompts = ["Hello, world!", {"prompt_token_ids": [5, 6, 7]}, "A third prompt"]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert len(outputs) == 3 and calls == prompts
    calls.clear()
    with pytest.raises(ConfigError):  # a bad one among them: nothing queued, the good ones read once
        llm.generate(["fine", {"prompt_token_ids": [10**9]}], SamplingParams(max_tokens=2), use_tqdm=False)
    assert calls == ["fine", {"prompt_token_ids": [10**9]}]
    assert_no_leaks(llm)
